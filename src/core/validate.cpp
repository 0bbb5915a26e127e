#include "core/validate.hpp"

#include <algorithm>
#include <sstream>

namespace tessera::detail {

namespace {

// "[a, b, c]" of a view's sizes or strides.
std::string extents_string(const int64_t* values, int ndim) {
  std::ostringstream out;
  out << "[";
  for (int i = 0; i < ndim; ++i) out << (i ? ", " : "") << values[i];
  out << "]";
  return out.str();
}

}  // namespace

std::string shape_string(const TensorView& view) {
  return extents_string(view.shape, view.ndim);
}

void ArgChecker::fail(std::string_view arg, const std::string& message) const {
  throw Error(Error::Kind::kInvalidArgument,
              "tessera::" + std::string(op_) + ": '" + std::string(arg) + "': " + message);
}

void ArgChecker::unsupported(std::string_view arg, const std::string& message) const {
  throw Error(Error::Kind::kUnsupported,
              "tessera::" + std::string(op_) + ": '" + std::string(arg) + "': " + message);
}

void ArgChecker::tensor(const TensorView& view, std::string_view arg, int ndim,
                        std::string_view layout) const {
  if (view.ndim != ndim) {
    fail(arg, "expected a " + std::to_string(ndim) + "-D tensor " + std::string(layout) + ", got " +
                  (view.ndim == 0 ? std::string("none")
                                  : std::to_string(view.ndim) + "-D " + shape_string(view)));
  }
  for (int i = 0; i < ndim; ++i) {
    if (view.shape[i] < 0) fail(arg, "negative size in shape " + shape_string(view));
    if (view.stride[i] < 0) fail(arg, "negative strides are not supported");
  }
  const int64_t numel = view.numel();
  if (numel > 0 && view.data == nullptr) fail(arg, "data pointer is null");
  if (numel > 0) {
    // Every element offset (row * stride + ...) and its byte address must fit in int64, as the
    // backends compute them; no tensor in memory spans 2^63 bytes. numel() saturates.
    bool overflow = numel == INT64_MAX;
    int64_t last = 0;  // the largest element offset
    for (int i = 0; i < ndim; ++i) {
      int64_t span = 0;
      overflow = overflow || __builtin_mul_overflow(view.shape[i] - 1, view.stride[i], &span) ||
                 __builtin_add_overflow(last, span, &last);
    }
    const int64_t element_bytes =
        std::max<int64_t>(1, static_cast<int64_t>(dtype_size(view.dtype)));
    int64_t count = 0, bytes = 0;  // elements up to and including the last, and their bytes
    if (overflow || __builtin_add_overflow(last, int64_t{1}, &count) ||
        __builtin_mul_overflow(count, element_bytes, &bytes)) {
      fail(arg, "shape " + shape_string(view) + " with strides " +
                    extents_string(view.stride, view.ndim) + " spans more than 2^63 - 1 bytes");
    }
  }
  if (view.shape[ndim - 1] > 1 && view.stride[ndim - 1] != 1) {
    fail(arg, "the last dimension must be contiguous (stride 1), got stride " +
                  std::to_string(view.stride[ndim - 1]));
  }
}

void ArgChecker::output(const TensorView& view, std::string_view arg) const {
  for (int i = 0; i < view.ndim; ++i) {
    if (view.shape[i] > 1 && view.stride[i] == 0) {
      fail(arg, "is an output, so its elements must not alias: stride 0 in dim " +
                    std::to_string(i) + " of size " + std::to_string(view.shape[i]));
    }
  }
}

void ArgChecker::dtype_in(const TensorView& view, std::string_view arg,
                          std::initializer_list<DType> allowed) const {
  std::string names;
  for (DType d : allowed) {
    if (d == view.dtype) return;
    names += (names.empty() ? "" : " or ") + std::string(dtype_name(d));
  }
  fail(arg, "expected dtype " + names + ", got " + dtype_name(view.dtype));
}

void ArgChecker::device_is(const TensorView& view, std::string_view arg, Device device) const {
  if (!(view.device == device)) {
    fail(arg, "expected a tensor on " + device_name(device) + ", got one on " +
                  device_name(view.device));
  }
}

void ArgChecker::dim_is(const TensorView& view, std::string_view arg, int dim, int64_t expected,
                        std::string_view what) const {
  if (view.shape[dim] != expected) {
    fail(arg, "expected size " + std::to_string(expected) + " (" + std::string(what) + ") in dim " +
                  std::to_string(dim) + ", got shape " + shape_string(view));
  }
}

void ArgChecker::index_array(const TensorView& view, std::string_view arg, int64_t length,
                             Device device) const {
  tensor(view, arg, 1, "of int32");
  dtype_is(view, arg, DType::kInt32);
  device_is(view, arg, device);
  if (length >= 0 && view.shape[0] != length) {
    fail(arg,
         "expected " + std::to_string(length) + " elements, got " + std::to_string(view.shape[0]));
  }
}

int64_t ArgChecker::indptr(std::span<const int32_t> values, std::string_view arg) const {
  if (values.empty()) fail(arg, "expected at least one element (batch_size + 1), got none");
  const auto name = [&] { return std::string(arg); };
  if (values[0] != 0) {
    fail(arg, "expected " + name() + "[0] == 0, got " + std::to_string(values[0]));
  }
  for (size_t i = 1; i < values.size(); ++i) {
    if (values[i] < values[i - 1]) {
      fail(arg, "must be non-decreasing, but " + name() + "[" + std::to_string(i) +
                    "] = " + std::to_string(values[i]) + " < " + name() + "[" +
                    std::to_string(i - 1) + "] = " + std::to_string(values[i - 1]));
    }
  }
  return values.back();
}

void check_heads(const ArgChecker& check, int num_qo_heads, int num_kv_heads, int head_dim,
                 int max_head_dim) {
  // kMaxHeads: a head count alone cannot make a plan of billions of work items.
  check.require(num_qo_heads >= 1 && num_qo_heads <= kMaxHeads, "num_qo_heads", [&] {
    return "expected 1.." + std::to_string(kMaxHeads) + ", got " + std::to_string(num_qo_heads);
  });
  check.require(num_kv_heads >= 1, "num_kv_heads",
                [&] { return "expected >= 1, got " + std::to_string(num_kv_heads); });
  check.require(num_qo_heads % num_kv_heads == 0, "num_qo_heads", [&] {
    return "expected a multiple of num_kv_heads (GQA ratio must be an integer), got " +
           std::to_string(num_qo_heads) + " query heads for " + std::to_string(num_kv_heads) +
           " kv heads";
  });
  check.require(head_dim >= 8 && head_dim <= max_head_dim && head_dim % 8 == 0, "head_dim", [&] {
    return "expected a multiple of 8 in [8, " + std::to_string(max_head_dim) + "], got " +
           std::to_string(head_dim);
  });
}

}  // namespace tessera::detail
