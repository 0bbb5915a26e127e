// Argument validation shared by every front end. Each check throws tessera::Error whose message
// names the operation, the argument and what was expected, before any memory is touched.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "tessera/types.hpp"

namespace tessera::detail {

std::string shape_string(const TensorView& view);

// Every check is on the hot path of run_*(): names, layouts and descriptions are string_views
// (no std::string is built per call) and a message is formatted only when a check fails (the
// lazy require takes a callable).
class ArgChecker {
 public:
  explicit ArgChecker(const char* op) : op_(op) {}
  explicit ArgChecker(std::string op) : owned_(std::move(op)), op_(owned_) {}
  ArgChecker(const ArgChecker&) = delete;
  ArgChecker& operator=(const ArgChecker&) = delete;

  [[noreturn]] void fail(std::string_view arg, const std::string& message) const;
  [[noreturn]] void unsupported(std::string_view arg, const std::string& message) const;
  // A fixed message; a formatted one goes through the lazy overload below (no eager
  // std::string overload: it would format on every passing call).
  void require(bool condition, std::string_view arg, const char* message) const {
    if (!condition) fail(arg, message);
  }
  // Lazy: `make_message()` (returning std::string) runs only when the check fails.
  template <class MakeMessage>
  requires std::is_invocable_r_v<std::string, MakeMessage>
  void require(bool condition, std::string_view arg, MakeMessage&& make_message) const {
    if (!condition) fail(arg, std::forward<MakeMessage>(make_message)());
  }

  // A present tensor of rank `ndim`: non-negative shape and strides, data for non-empty tensors,
  // unit stride on the last dim (when ndim > 0 and that dim has more than one element).
  void tensor(const TensorView& view, std::string_view arg, int ndim,
              std::string_view layout) const;
  // An output: no two of its elements may alias (stride > 0 on every dim of size > 1).
  void output(const TensorView& view, std::string_view arg) const;
  void dtype_in(const TensorView& view, std::string_view arg,
                std::initializer_list<DType> allowed) const;
  void dtype_is(const TensorView& view, std::string_view arg, DType dtype) const {
    if (view.dtype != dtype) dtype_in(view, arg, {dtype});
  }
  void device_is(const TensorView& view, std::string_view arg, Device device) const;
  void dim_is(const TensorView& view, std::string_view arg, int dim, int64_t expected,
              std::string_view what) const;
  // A 1-D contiguous int32 tensor of `length` elements (length < 0: any).
  void index_array(const TensorView& view, std::string_view arg, int64_t length,
                   Device device) const;
  // A CSR indptr on the host: size >= 1, starts at 0, non-decreasing; returns the last value.
  int64_t indptr(std::span<const int32_t> values, std::string_view arg) const;

  std::string_view op() const { return op_; }

 private:
  std::string owned_;
  std::string_view op_;
};

// At most this many query heads (attention) or heads (the aux ops): the planner makes a work
// item per (query tile, kv head) and the op kernels index heads in 32 bits.
inline constexpr int kMaxHeads = 65536;

// head_dim: a multiple of 8 in [8, max_head_dim] (256 for the generic ops; MLA's entry points,
// which check their own widths, pass a larger bound for kv_lora_rank + rope_dim).
void check_heads(const ArgChecker& check, int num_qo_heads, int num_kv_heads, int head_dim,
                 int max_head_dim = 256);

}  // namespace tessera::detail
