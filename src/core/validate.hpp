// Argument validation shared by every front end. Each check throws tessera::Error whose message
// names the operation, the argument and what was expected, before any memory is touched.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>

#include "tessera/types.hpp"

namespace tessera::detail {

std::string shape_string(const TensorView& view);

class ArgChecker {
 public:
  explicit ArgChecker(std::string op) : op_(std::move(op)) {}

  [[noreturn]] void fail(const std::string& arg, const std::string& message) const;
  [[noreturn]] void unsupported(const std::string& arg, const std::string& message) const;
  void require(bool condition, const std::string& arg, const std::string& message) const {
    if (!condition) fail(arg, message);
  }

  // A present tensor of rank `ndim`: non-negative shape and strides, data for non-empty tensors,
  // unit stride on the last dim (when ndim > 0 and that dim has more than one element).
  void tensor(const TensorView& view, const std::string& arg, int ndim,
              const std::string& layout) const;
  // An output: no two of its elements may alias (stride > 0 on every dim of size > 1).
  void output(const TensorView& view, const std::string& arg) const;
  void dtype_in(const TensorView& view, const std::string& arg,
                std::initializer_list<DType> allowed) const;
  void dtype_is(const TensorView& view, const std::string& arg, DType dtype) const {
    dtype_in(view, arg, {dtype});
  }
  void device_is(const TensorView& view, const std::string& arg, Device device) const;
  void dim_is(const TensorView& view, const std::string& arg, int dim, int64_t expected,
              const std::string& what) const;
  // A 1-D contiguous int32 tensor of `length` elements (length < 0: any).
  void index_array(const TensorView& view, const std::string& arg, int64_t length,
                   Device device) const;
  // A CSR indptr on the host: size >= 1, starts at 0, non-decreasing; returns the last value.
  int64_t indptr(std::span<const int32_t> values, const std::string& arg) const;

  const std::string& op() const { return op_; }

 private:
  std::string op_;
};

void check_heads(const ArgChecker& check, int num_qo_heads, int num_kv_heads, int head_dim);

}  // namespace tessera::detail
