// The harness of fuzz/fuzz_capi.cpp (its only includer): guarded host tensors (Tensor), the
// arena that makes, mutates and finalises them and checks a call's byte-level invariants, and
// the random pieces every generator shares (options, head dims, dtypes, paged caches,
// workspaces).
#pragma once

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <vector>

#include "tessera/tessera.h"

namespace {

constexpr size_t kGuard = 64;
constexpr int64_t kMaxBytes = int64_t{1} << 22;

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "fuzz_capi: invariant violated: %s (last error: '%s')\n", what,
               tessera_last_error());
  std::abort();
}

enum ElemKind { kF32, kF16, kBF16, kE4M3, kE5M2, kI32, kI64, kU8 };

DLDataType dl_type(ElemKind kind) {
  switch (kind) {
    case kF32: return {kDLFloat, 32, 1};
    case kF16: return {kDLFloat, 16, 1};
    case kBF16: return {kDLBfloat, 16, 1};
    case kE4M3: return {TESSERA_DL_FLOAT8_E4M3FN, 8, 1};
    case kE5M2: return {TESSERA_DL_FLOAT8_E5M2, 8, 1};
    case kI32: return {kDLInt, 32, 1};
    case kI64: return {kDLInt, 64, 1};
    case kU8: return {kDLUInt, 8, 1};  // bit-packed masks
  }
  return {kDLFloat, 32, 1};
}

int elem_bytes(DLDataType t) { return std::max(1, (t.bits * t.lanes + 7) / 8); }

// One tensor: a descriptor plus its guarded block.
struct Tensor {
  DLTensor t{};
  int64_t shape[4] = {0, 0, 0, 0};
  int64_t strides[4] = {0, 0, 0, 0};
  bool explicit_strides = true;
  bool output = false;  // written by the call (in-place ops included)
  bool null_descriptor = false;
  std::vector<int32_t> ints;  // contents of an int32 tensor (before layout)
  std::vector<uint8_t> block, before;
  int64_t extent = 0;  // bytes between the guards
  bool allocated = false;
  bool no_mutate = false;  // the workspace: its size is passed separately

  const DLTensor* get() const { return null_descriptor ? nullptr : &t; }
};

struct Arena {
  std::vector<std::unique_ptr<Tensor>> tensors;
  FuzzedDataProvider* fdp;
  uint64_t seed;

  uint32_t next() {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<uint32_t>(seed >> 33);
  }

  Tensor* make(ElemKind kind, std::initializer_list<int64_t> shape, bool output,
               int64_t pad_outer = 0, int64_t pad_inner = 0) {
    auto tensor = std::make_unique<Tensor>();
    Tensor* x = tensor.get();
    tensors.push_back(std::move(tensor));
    x->t.ndim = static_cast<int>(shape.size());
    x->t.dtype = dl_type(kind);
    x->t.device = {kDLCPU, 0};
    x->output = output;
    int i = 0;
    for (int64_t s : shape) x->shape[i++] = s;
    // Row-major, plus `pad_inner` elements after every row of dim ndim-2 (ndim >= 3) and
    // `pad_outer` after every outermost row.
    const int n = x->t.ndim;
    x->strides[n - 1] = 1;
    for (int d = n - 2; d >= 0; --d) {
      x->strides[d] = x->strides[d + 1] * std::max<int64_t>(x->shape[d + 1], 1) +
                      (d == n - 2 && d > 0 ? pad_inner : 0) + (d == 0 ? pad_outer : 0);
    }
    x->explicit_strides = pad_outer != 0 || pad_inner != 0 || (next() & 3) == 0;
    return x;
  }

  Tensor* ints(const std::vector<int32_t>& values, bool output = false) {
    Tensor* x = make(kI32, {static_cast<int64_t>(values.size())}, output);
    x->ints = values;
    return x;
  }
  // The same values in an int64 tensor.
  Tensor* ints64(const std::vector<int32_t>& values) {
    Tensor* x = make(kI64, {static_cast<int64_t>(values.size())}, false);
    x->ints = values;
    return x;
  }

  // value += delta, unless that overflows (the harness's own arithmetic must stay defined;
  // UBSan stops the run on it, as it did on an int32 index at INT32_MIN).
  template <class T>
  static void add_unless_overflow(T& value, int delta) {
    T sum;
    if (!__builtin_add_overflow(value, delta, &sum)) value = sum;
  }

  // Mutates one random tensor in a way the library must either accept correctly or reject.
  void mutate() {
    if (tensors.empty()) return;
    Tensor* x = tensors[fdp->ConsumeIntegralInRange<size_t>(0, tensors.size() - 1)].get();
    if (x->no_mutate) return;
    const int d = fdp->ConsumeIntegralInRange<int>(0, std::clamp(x->t.ndim, 1, 4) - 1);
    switch (fdp->ConsumeIntegralInRange<int>(0, 13)) {
      case 0: add_unless_overflow(x->shape[d], fdp->ConsumeIntegralInRange<int>(-2, 2)); break;
      case 1: x->strides[d] = fdp->ConsumeIntegralInRange<int>(-1, 3); x->explicit_strides = true; break;
      case 2: x->t.dtype = dl_type(static_cast<ElemKind>(fdp->ConsumeIntegralInRange<int>(0, 7))); break;
      case 3: x->t.dtype.lanes = 2; break;
      case 4: x->t.device = {static_cast<DLDeviceType>(fdp->ConsumeIntegralInRange<int>(1, 16)), 0}; break;
      case 5: x->null_descriptor = true; break;
      case 6: x->t.ndim = fdp->ConsumeIntegralInRange<int>(0, 5); break;
      case 7: x->shape[d] = int64_t{1} << fdp->ConsumeIntegralInRange<int>(31, 62); break;
      case 8: x->shape[d] = -fdp->ConsumeIntegralInRange<int64_t>(1, INT64_MAX); break;
      case 9:
        if (!x->ints.empty()) {
          x->ints[fdp->ConsumeIntegralInRange<size_t>(0, x->ints.size() - 1)] =
              fdp->ConsumeIntegral<int32_t>();
        }
        break;
      case 10:
        if (!x->ints.empty()) {
          add_unless_overflow(x->ints[fdp->ConsumeIntegralInRange<size_t>(0, x->ints.size() - 1)],
                              fdp->ConsumeIntegralInRange<int>(-2, 2));
        }
        break;
      case 11:
        add_unless_overflow(x->strides[d], fdp->ConsumeIntegralInRange<int>(1, 5));
        x->explicit_strides = true;
        break;
      case 12: x->explicit_strides = !x->explicit_strides; break;
      case 13: x->t.dtype.bits = static_cast<uint8_t>(fdp->ConsumeIntegral<uint8_t>()); break;
    }
  }

  // Allocates every tensor's block for its final descriptor and fills it.
  void finalize() {
    for (auto& owned : tensors) {
      Tensor& x = *owned;
      x.t.shape = x.shape;
      x.t.strides = x.explicit_strides ? x.strides : nullptr;
      const int ndim = std::clamp(x.t.ndim, 0, 4);
      int64_t last = 0;  // max element offset
      bool too_big = false, empty = false;
      for (int d = 0; d < ndim; ++d) {
        if (x.shape[d] <= 0) empty = true;
      }
      int64_t contiguous = 1;
      for (int d = ndim - 1; d >= 0 && !empty; --d) {
        const int64_t stride = x.explicit_strides ? x.strides[d] : contiguous;
        if (stride < 0) continue;  // rejected by the library; cover what we can
        int64_t span;
        if (__builtin_mul_overflow(x.shape[d] - 1, stride, &span) ||
            __builtin_add_overflow(last, span, &last) ||
            __builtin_mul_overflow(contiguous, x.shape[d], &contiguous)) {
          too_big = true;
          break;
        }
      }
      int64_t bytes = 0;
      if (!empty && !too_big && __builtin_mul_overflow(last + 1, elem_bytes(x.t.dtype), &bytes)) {
        too_big = true;
      }
      if (too_big || bytes > kMaxBytes || bytes < 0) {
        x.extent = 0;
        x.block.assign(2 * kGuard, 0xEE);
        x.t.data = nullptr;  // "cannot exist": the library must reject before reading
        continue;
      }
      x.extent = bytes;
      x.block.assign(2 * kGuard + static_cast<size_t>(bytes), 0xEE);
      x.allocated = true;
      x.t.data = x.block.data() + kGuard;
      x.t.byte_offset = 0;
      uint8_t* data = x.block.data() + kGuard;
      if (!x.ints.empty() && x.t.dtype.code == kDLInt && x.t.dtype.bits == 32 &&
          !x.explicit_strides) {
        const size_t n = std::min<size_t>(x.ints.size(), static_cast<size_t>(bytes) / 4);
        std::memcpy(data, x.ints.data(), n * 4);
      } else if (!x.ints.empty() && x.t.dtype.code == kDLInt && x.t.dtype.bits == 64 && ndim == 1 &&
                 (!x.explicit_strides || x.strides[0] >= 0)) {
        const int64_t stride = x.explicit_strides ? x.strides[0] : 1;
        for (int64_t i = 0; i < x.shape[0] && i < static_cast<int64_t>(x.ints.size()); ++i) {
          const int64_t value = x.ints[i];
          std::memcpy(data + i * stride * 8, &value, 8);
        }
      } else if (!x.ints.empty() && x.t.dtype.code == kDLInt && x.t.dtype.bits == 32 && ndim == 1 &&
                 x.strides[0] >= 0) {
        for (int64_t i = 0; i < x.shape[0] && i < static_cast<int64_t>(x.ints.size()); ++i) {
          std::memcpy(data + i * x.strides[0] * 4, &x.ints[i], 4);
        }
      } else {
        fill_values(x, data, bytes);
      }
      if (fdp->ConsumeBool() && bytes > 0) {
        // Occasionally non-finite / arbitrary bytes.
        data[fdp->ConsumeIntegralInRange<int64_t>(0, bytes - 1)] = fdp->ConsumeIntegral<uint8_t>();
      }
    }
    for (auto& x : tensors) x->before = x->block;
  }

  void fill_values(const Tensor& x, uint8_t* data, int64_t bytes) {
    const DLDataType t = x.t.dtype;
    const int size = elem_bytes(t);
    for (int64_t i = 0; i + size <= bytes; i += size) {
      const uint32_t r = next();
      const uint8_t s = static_cast<uint8_t>(r & 0x80);
      if (t.code == kDLFloat && t.bits == 32) {
        const uint8_t b[4] = {static_cast<uint8_t>(r >> 8), static_cast<uint8_t>(r >> 16),
                              static_cast<uint8_t>(0x80 | (r & 0x7F)),
                              static_cast<uint8_t>(s | 0x3F)};
        std::memcpy(data + i, b, 4);
      } else if (t.code == kDLFloat && t.bits == 16) {
        data[i] = static_cast<uint8_t>(r >> 8);
        data[i + 1] = static_cast<uint8_t>(s | 0x38 | ((r >> 16) & 3));
      } else if (t.code == kDLBfloat && t.bits == 16) {
        data[i] = static_cast<uint8_t>(0x80 | ((r >> 8) & 0x7F));
        data[i + 1] = static_cast<uint8_t>(s | 0x3F);
      } else if (t.code == TESSERA_DL_FLOAT8_E4M3FN) {
        data[i] = static_cast<uint8_t>(s | 0x30 | ((r >> 8) & 0x0F));
      } else if (t.code == TESSERA_DL_FLOAT8_E5M2) {
        data[i] = static_cast<uint8_t>(s | 0x38 | ((r >> 8) & 0x07));
      } else {
        for (int k = 0; k < size; ++k) data[i + k] = static_cast<uint8_t>(r >> (8 * (k % 4)));
      }
    }
  }

  // Checks the byte-level invariants after a call.
  void check(tessera_status status) const {
    const char* error = tessera_last_error();
    if (error == nullptr) die("tessera_last_error() returned NULL");
    if (status == TESSERA_OK) {
      if (error[0] != '\0') die("success with a non-empty last error");
    } else {
      if (status < TESSERA_ERROR_INVALID_ARGUMENT || status > TESSERA_ERROR_OUT_OF_MEMORY) {
        die("unknown status code");
      }
      if (error[0] == '\0') die("failure with an empty last error");
    }
    for (const auto& owned : tensors) {
      const Tensor& x = *owned;
      if (x.block == x.before) continue;
      if (status != TESSERA_OK) die("a failed call wrote memory");
      if (!x.output || x.null_descriptor) die("a call wrote a tensor that is not an output");
      if (x.t.ndim < 1 || x.t.ndim > 4) die("a call accepted a tensor with ndim outside 1..4");
      // Which bytes belong to the output's elements (the descriptor the library saw).
      std::vector<uint8_t> mine(x.block.size(), 0);
      const int size = elem_bytes(x.t.dtype);
      const int ndim = x.t.ndim;
      std::vector<int64_t> index(ndim, 0);
      int64_t contiguous[4];
      int64_t c = 1;
      for (int d = ndim - 1; d >= 0; --d) {
        contiguous[d] = c;
        c *= x.shape[d];
      }
      bool done = false;
      for (int d = 0; d < ndim; ++d) done |= x.shape[d] <= 0;
      while (!done) {
        int64_t offset = 0;
        for (int d = 0; d < ndim; ++d) {
          offset += index[d] * (x.explicit_strides ? x.strides[d] : contiguous[d]);
        }
        for (int k = 0; k < size; ++k) mine[kGuard + offset * size + k] = 1;
        int d = ndim - 1;
        while (d >= 0 && ++index[d] == x.shape[d]) index[d--] = 0;
        done = d < 0;
      }
      for (size_t i = 0; i < x.block.size(); ++i) {
        if (!mine[i] && x.block[i] != x.before[i]) die("a byte outside an output was written");
      }
    }
  }
};

int32_t small(FuzzedDataProvider& fdp, int lo, int hi) {
  return fdp.ConsumeIntegralInRange<int32_t>(lo, hi);
}

tessera_attention_options attention_options(FuzzedDataProvider& fdp) {
  tessera_attention_options o;
  tessera_attention_options_default(&o);
  o.causal = fdp.ConsumeBool();
  if (fdp.ConsumeBool()) o.window_left = small(fdp, -2, 8);
  if (fdp.ConsumeBool()) o.window_right = small(fdp, -2, 8);
  switch (fdp.ConsumeIntegralInRange<int>(0, 5)) {
    case 1: o.logits_soft_cap = fdp.ConsumeFloatingPointInRange<float>(0.0f, 60.0f); break;
    case 2: o.logits_soft_cap = fdp.ConsumeFloatingPoint<float>(); break;
    case 3: o.sm_scale = fdp.ConsumeFloatingPointInRange<float>(0.0f, 4.0f); break;
    case 4: o.sm_scale = fdp.ConsumeFloatingPoint<float>(); break;
    case 5:
      o.k_scale = fdp.ConsumeFloatingPoint<float>();
      o.v_scale = fdp.ConsumeFloatingPointInRange<float>(-1.0f, 4.0f);
      break;
    default: break;
  }
  return o;
}

int head_dim(FuzzedDataProvider& fdp) {
  static const int kDims[] = {8, 16, 24, 32, 64, 128, 256, 0, 7, 264};
  const int i = fdp.ConsumeIntegralInRange<int>(0, 31);
  return i < 10 ? kDims[i] : 8 * (1 + i % 4);
}

ElemKind q_kind(FuzzedDataProvider& fdp) {
  static const ElemKind k[] = {kF16, kBF16, kF32};
  return k[fdp.ConsumeIntegralInRange<int>(0, 2)];
}

ElemKind kv_kind(FuzzedDataProvider& fdp, ElemKind q) {
  switch (fdp.ConsumeIntegralInRange<int>(0, 5)) {
    case 0: return kE4M3;
    case 1: return kE5M2;
    default: return q;
  }
}

std::vector<int32_t> indptr_of(const std::vector<int32_t>& lens) {
  std::vector<int32_t> indptr(lens.size() + 1, 0);
  for (size_t i = 0; i < lens.size(); ++i) indptr[i + 1] = indptr[i] + lens[i];
  return indptr;
}

// A paged cache for kv_lens: page table (random page order) plus k/v caches.
struct Paged {
  Tensor *k, *v, *indptr, *indices, *last;
  std::vector<int32_t> page_indptr, last_page_len;
  int page_size, layout;
  tessera_paged_kv kv() const {
    return {k->get(), v->get(), indptr->get(), indices->get(), last->get(), layout};
  }
};

// dim_v: v_cache's last dimension (head_dim_vo; < 0: dim).
Paged make_paged(Arena& arena, FuzzedDataProvider& fdp, const std::vector<int32_t>& kv_lens,
                 int page_size, int hkv, int dim, ElemKind kind, bool cache_output,
                 int dim_v = -1) {
  Paged p;
  p.page_size = page_size;
  p.layout = fdp.ConsumeIntegralInRange<int>(0, 9) == 0 ? small(fdp, -1, 3) : small(fdp, 0, 1);
  std::vector<int32_t> pages_per;
  for (int32_t len : kv_lens) pages_per.push_back((len + page_size - 1) / page_size);
  p.page_indptr = indptr_of(pages_per);
  for (size_t b = 0; b < kv_lens.size(); ++b) {
    p.last_page_len.push_back(kv_lens[b] == 0 ? small(fdp, 0, page_size)
                                              : kv_lens[b] - (pages_per[b] - 1) * page_size);
  }
  const int32_t used = p.page_indptr.back();
  const int32_t num_pages = used + small(fdp, 0, 3);
  std::vector<int32_t> order(num_pages);
  std::iota(order.begin(), order.end(), 0);
  for (int32_t i = num_pages - 1; i > 0; --i) std::swap(order[i], order[arena.next() % (i + 1)]);
  order.resize(used + small(fdp, 0, 2));
  for (size_t i = used; i < order.size(); ++i) order[i] = small(fdp, -1, num_pages);
  const int64_t pad = small(fdp, 0, 2) * 8;
  const bool nhd = p.layout != TESSERA_KV_LAYOUT_HND;
  const int64_t d1 = nhd ? page_size : hkv, d2 = nhd ? hkv : page_size;
  p.k = arena.make(kind, {num_pages, d1, d2, dim}, cache_output, pad, 0);
  p.v = arena.make(kind, {num_pages, d1, d2, dim_v < 0 ? dim : dim_v}, cache_output, 0, pad);
  p.indptr = arena.ints(p.page_indptr);
  p.indices = arena.ints(order);
  p.last = arena.ints(p.last_page_len);
  return p;
}

struct Workspace {
  Tensor* tensor = nullptr;
  void* data() const { return tensor->t.data; }
  size_t bytes = 0;
};

Workspace make_workspace(Arena& arena, FuzzedDataProvider& fdp, const tessera_plan* plan) {
  Workspace w;
  size_t bytes = tessera_plan_workspace_bytes(plan);
  if (fdp.ConsumeIntegralInRange<int>(0, 15) == 0 && bytes > 0) bytes -= 1;
  w.bytes = bytes;
  w.tensor = arena.make(kI64, {static_cast<int64_t>(bytes / 8 + 1)}, /*output=*/true);
  w.tensor->no_mutate = true;
  w.tensor->explicit_strides = false;
  return w;
}

}  // namespace
