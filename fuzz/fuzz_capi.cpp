// libFuzzer target for the C ABI (include/tessera/tessera.h) on CPU tensors.
//
// The input decodes into one call: an attention op (plan + run, or one-shot; ragged, paged,
// decode; through the plain calls or the *_v2 ones with fuzzed run options: sinks, PDL,
// struct_size) or an aux op (RoPE, paged-KV append, block_table -> CSR, merge_state(s)), with random
// shapes, dtypes, strides, index arrays, page tables and options. Arguments start out mostly
// valid (so kernels run on random shapes) and then get a few random mutations (dims, strides,
// dtypes, devices, NULLs, index contents). Every tensor lives in its own heap block with guard
// bytes on both sides. After the call:
//  - the status is OK with tessera_last_error() == "", or an error with a non-empty text;
//  - a failed call changed no byte of any buffer (arguments are validated before any write);
//  - a successful call changed no byte of a read-only tensor, and no byte of an output's block
//    outside the output's elements (stride padding and guards included);
//  - ASan / UBSan see no invalid access (a NULL data pointer stands for "too large to allocate":
//    the library must reject it before reading).
// Build and run: tools/fuzz.sh.
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

enum ElemKind { kF32, kF16, kBF16, kE4M3, kE5M2, kI32, kI64 };

DLDataType dl_type(ElemKind kind) {
  switch (kind) {
    case kF32: return {kDLFloat, 32, 1};
    case kF16: return {kDLFloat, 16, 1};
    case kBF16: return {kDLBfloat, 16, 1};
    case kE4M3: return {TESSERA_DL_FLOAT8_E4M3FN, 8, 1};
    case kE5M2: return {TESSERA_DL_FLOAT8_E5M2, 8, 1};
    case kI32: return {kDLInt, 32, 1};
    case kI64: return {kDLInt, 64, 1};
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
      case 2: x->t.dtype = dl_type(static_cast<ElemKind>(fdp->ConsumeIntegralInRange<int>(0, 6))); break;
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

Paged make_paged(Arena& arena, FuzzedDataProvider& fdp, const std::vector<int32_t>& kv_lens,
                 int page_size, int hkv, int dim, ElemKind kind, bool cache_output) {
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
  p.v = arena.make(kind, {num_pages, d1, d2, dim}, cache_output, 0, pad);
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

void attention(Arena& arena, FuzzedDataProvider& fdp) {
  const int mode = fdp.ConsumeIntegralInRange<int>(0, 5);  // ragged/paged/decode x plan/oneshot
  const int op = mode % 3;
  const bool one_shot = mode >= 3;
  const int batch = small(fdp, 0, 4);
  const int hkv = small(fdp, 1, 3), group = small(fdp, 1, 4), dim = head_dim(fdp);
  int hqo = hkv * group;
  if (fdp.ConsumeIntegralInRange<int>(0, 15) == 0) hqo = small(fdp, -1, 7);
  const int q_per_request = small(fdp, op == 2 ? 1 : 0, 4);
  const int page_size = fdp.ConsumeIntegralInRange<int>(0, 15) == 0 ? small(fdp, -1, 0)
                                                                     : small(fdp, 1, 8);
  std::vector<int32_t> q_lens, kv_lens;
  for (int b = 0; b < batch; ++b) {
    q_lens.push_back(op == 2 ? q_per_request : small(fdp, 0, 7));
    kv_lens.push_back(small(fdp, 0, 20));
  }
  const std::vector<int32_t> qo_indptr = indptr_of(q_lens);
  const std::vector<int32_t> kv_indptr = indptr_of(kv_lens);
  const int64_t total_q = qo_indptr.back(), total_kv = kv_indptr.back();
  const ElemKind qk = q_kind(fdp), kvk = kv_kind(fdp, qk);
  tessera_attention_options options = attention_options(fdp);
  const bool null_options = fdp.ConsumeIntegralInRange<int>(0, 7) == 0;
  const tessera_attention_options* opts = null_options ? nullptr : &options;

  Tensor* q = arena.make(qk, {total_q, hqo, dim}, false, small(fdp, 0, 2) * 8, small(fdp, 0, 1) * 8);
  Tensor* o = arena.make(qk, {total_q, hqo, dim}, true, small(fdp, 0, 2) * 8, small(fdp, 0, 1) * 8);
  Tensor* lse = fdp.ConsumeBool() ? arena.make(kF32, {total_q, hqo}, true, small(fdp, 0, 3), 0)
                                  : nullptr;
  // The *_v2 calls' per-call options: sinks of a fuzzed dtype and length (their values are the
  // arena's fill: NaN and inf included, which checked mode and the kernels define), PDL, and a
  // struct_size from 0 (no field read) up to the struct's.
  const bool v2 = fdp.ConsumeBool();
  tessera_run_options run_options;
  tessera_run_options_default(&run_options);
  Tensor* sinks = nullptr;
  if (v2) {
    if (fdp.ConsumeBool()) {
      const ElemKind sink_kind = fdp.ConsumeIntegralInRange<int>(0, 7) == 0 ? q_kind(fdp) : kF32;
      const int64_t heads = fdp.ConsumeIntegralInRange<int>(0, 7) == 0
                                ? small(fdp, 0, std::max(hqo, 0) + 2)
                                : hqo;
      sinks = arena.make(sink_kind, {heads}, false);
    }
    run_options.enable_pdl = fdp.ConsumeBool();
    if (fdp.ConsumeIntegralInRange<int>(0, 7) == 0) {
      run_options.struct_size = fdp.ConsumeIntegralInRange<size_t>(0, sizeof run_options);
    }
  }
  Tensor *k = nullptr, *v = nullptr, *qo = nullptr, *kvp = nullptr;
  Paged paged{};
  if (op == 0) {
    const int64_t extra = small(fdp, 0, 2);
    k = arena.make(kvk, {total_kv + extra, hkv, dim}, false, small(fdp, 0, 2) * 8, 0);
    v = arena.make(kvk, {total_kv + extra, hkv, dim}, false, 0, small(fdp, 0, 2) * 8);
    qo = arena.ints(qo_indptr);
    kvp = arena.ints(kv_indptr);
  } else {
    paged = make_paged(arena, fdp, kv_lens, std::max(page_size, 1), hkv, dim, kvk, false);
    if (op == 1) qo = arena.ints(qo_indptr);
  }

  tessera_plan* plan = nullptr;
  tessera_status status = TESSERA_OK;
  // Host arrays for the planner (possibly perturbed independently of the tensors).
  std::vector<int32_t> plan_qo = qo_indptr, plan_kv = kv_indptr;
  std::vector<int32_t> plan_pages = paged.page_indptr, plan_last = paged.last_page_len;
  if (!one_shot && fdp.ConsumeIntegralInRange<int>(0, 7) == 0) {
    std::vector<int32_t>* arrays[] = {&plan_qo, &plan_kv, &plan_pages, &plan_last};
    std::vector<int32_t>& a = *arrays[fdp.ConsumeIntegralInRange<int>(0, 3)];
    if (!a.empty()) a[fdp.ConsumeIntegralInRange<size_t>(0, a.size() - 1)] += small(fdp, -3, 3);
  }
  const int device_type = fdp.ConsumeIntegralInRange<int>(0, 15) == 0 ? small(fdp, 0, 16) : kDLCPU;
  if (!one_shot) {
    if (op == 0) {
      status = tessera_plan_ragged_prefill(plan_qo.data(), plan_kv.data(), batch, hqo, hkv, dim,
                                           opts, device_type, 0, &plan);
    } else if (op == 1) {
      status = tessera_plan_paged_prefill(plan_qo.data(), plan_pages.data(), plan_last.data(),
                                          batch, page_size, hqo, hkv, dim, opts, device_type, 0,
                                          &plan);
    } else {
      status = tessera_plan_decode(plan_pages.data(), plan_last.data(), batch, page_size, hqo,
                                   hkv, dim, q_per_request, opts, device_type, 0, &plan);
    }
    arena.check(status);
    if (status != TESSERA_OK) {
      if (plan != nullptr) die("failed plan call returned a plan");
      return;
    }
    if (plan == nullptr) die("successful plan call returned NULL");
    size_t needed = 0;
    char text[64];
    const tessera_status explain = tessera_plan_explain(plan, text, sizeof text, &needed);
    if (needed == 0 || (explain == TESSERA_OK) != (needed <= sizeof text)) die("plan_explain");
    if (std::strlen(text) + 1 > sizeof text) die("plan_explain: not NUL-terminated");
  }
  Workspace workspace;
  if (plan != nullptr) workspace = make_workspace(arena, fdp, plan);

  const int mutations = fdp.ConsumeIntegralInRange<int>(0, 3);
  for (int i = 0; i < mutations; ++i) arena.mutate();
  arena.finalize();
  const tessera_paged_kv kv = op == 0 ? tessera_paged_kv{} : paged.kv();
  const DLTensor* lse_t = lse ? lse->get() : nullptr;
  void* ws = workspace.tensor ? workspace.data() : nullptr;
  const bool null_kv = fdp.ConsumeIntegralInRange<int>(0, 31) == 0;
  run_options.sinks = sinks != nullptr ? sinks->get() : nullptr;
  const tessera_run_options* ro =
      v2 && fdp.ConsumeIntegralInRange<int>(0, 15) != 0 ? &run_options : nullptr;
  if (v2 && one_shot) {
    if (op == 0) {
      status = tessera_ragged_prefill_v2(q->get(), k->get(), v->get(), qo->get(), kvp->get(),
                                         o->get(), lse_t, opts, nullptr, ro);
    } else if (op == 1) {
      status = tessera_paged_prefill_v2(q->get(), null_kv ? nullptr : &kv, qo->get(), o->get(),
                                        lse_t, opts, nullptr, ro);
    } else {
      status = tessera_decode_v2(q->get(), null_kv ? nullptr : &kv, o->get(), lse_t, opts,
                                 nullptr, ro);
    }
  } else if (v2) {
    const tessera_plan* run_plan = fdp.ConsumeIntegralInRange<int>(0, 31) == 0 ? nullptr : plan;
    if (op == 0) {
      status = tessera_run_ragged_prefill_v2(run_plan, q->get(), k->get(), v->get(), qo->get(),
                                             kvp->get(), o->get(), lse_t, ws, workspace.bytes,
                                             nullptr, ro);
    } else if (op == 1) {
      status = tessera_run_paged_prefill_v2(run_plan, q->get(), null_kv ? nullptr : &kv,
                                            qo->get(), o->get(), lse_t, ws, workspace.bytes,
                                            nullptr, ro);
    } else {
      status = tessera_run_decode_v2(run_plan, q->get(), null_kv ? nullptr : &kv, o->get(),
                                     lse_t, ws, workspace.bytes, nullptr, ro);
    }
  } else if (one_shot) {
    if (op == 0) {
      status = tessera_ragged_prefill(q->get(), k->get(), v->get(), qo->get(), kvp->get(),
                                      o->get(), lse_t, opts, nullptr);
    } else if (op == 1) {
      status = tessera_paged_prefill(q->get(), null_kv ? nullptr : &kv, qo->get(), o->get(),
                                     lse_t, opts, nullptr);
    } else {
      status = tessera_decode(q->get(), null_kv ? nullptr : &kv, o->get(), lse_t, opts, nullptr);
    }
  } else {
    const tessera_plan* run_plan = fdp.ConsumeIntegralInRange<int>(0, 31) == 0 ? nullptr : plan;
    if (op == 0) {
      status = tessera_run_ragged_prefill(run_plan, q->get(), k->get(), v->get(), qo->get(),
                                          kvp->get(), o->get(), lse_t, ws, workspace.bytes,
                                          nullptr);
    } else if (op == 1) {
      status = tessera_run_paged_prefill(run_plan, q->get(), null_kv ? nullptr : &kv, qo->get(),
                                         o->get(), lse_t, ws, workspace.bytes, nullptr);
    } else {
      status = tessera_run_decode(run_plan, q->get(), null_kv ? nullptr : &kv, o->get(), lse_t,
                                  ws, workspace.bytes, nullptr);
    }
  }
  arena.check(status);
  tessera_plan_destroy(plan);
}

tessera_rope_options rope_options(FuzzedDataProvider& fdp, int dim) {
  tessera_rope_options r;
  tessera_rope_options_default(&r);
  if (fdp.ConsumeBool()) r.rotary_dim = small(fdp, -2, dim + 2);
  r.interleave = fdp.ConsumeBool();
  if (fdp.ConsumeBool()) r.rope_theta = fdp.ConsumeFloatingPoint<float>();
  if (fdp.ConsumeBool()) r.rope_scale = fdp.ConsumeFloatingPoint<float>();
  r.llama31 = fdp.ConsumeBool();
  if (fdp.ConsumeBool()) {
    r.llama31_factor = fdp.ConsumeFloatingPoint<float>();
    r.llama31_low_freq_factor = fdp.ConsumeFloatingPoint<float>();
    r.llama31_high_freq_factor = fdp.ConsumeFloatingPoint<float>();
    r.llama31_original_max_position = fdp.ConsumeIntegral<int32_t>();
  }
  return r;
}

void rope(Arena& arena, FuzzedDataProvider& fdp) {
  const int64_t nnz = small(fdp, 0, 6);
  const int dim = head_dim(fdp);
  const ElemKind kind = q_kind(fdp);
  Tensor* q = fdp.ConsumeBool() ? arena.make(kind, {nnz, small(fdp, 1, 4), dim}, true, small(fdp, 0, 2) * 8, 0) : nullptr;
  Tensor* k = fdp.ConsumeBool() ? arena.make(kind, {nnz, small(fdp, 1, 4), dim}, true, 0, small(fdp, 0, 2) * 8) : nullptr;
  std::vector<int32_t> pos(nnz);
  for (auto& p : pos) p = fdp.ConsumeIntegralInRange<int32_t>(-2, 100000);
  Tensor* positions = arena.ints(pos);
  const tessera_rope_options options = rope_options(fdp, dim);
  const bool null_options = fdp.ConsumeIntegralInRange<int>(0, 7) == 0;
  const int mutations = fdp.ConsumeIntegralInRange<int>(0, 3);
  for (int i = 0; i < mutations; ++i) arena.mutate();
  arena.finalize();
  arena.check(tessera_apply_rope_inplace(q ? q->get() : nullptr, k ? k->get() : nullptr,
                                         positions->get(), null_options ? nullptr : &options,
                                         nullptr));
}

void append(Arena& arena, FuzzedDataProvider& fdp) {
  const int batch = small(fdp, 0, 4);
  const int hkv = small(fdp, 1, 3), dim = head_dim(fdp), page_size = small(fdp, 1, 8);
  std::vector<int32_t> kv_lens, append_lens;
  for (int b = 0; b < batch; ++b) {
    kv_lens.push_back(small(fdp, 0, 20));
    append_lens.push_back(small(fdp, 0, kv_lens.back()));
  }
  const std::vector<int32_t> append_indptr = indptr_of(append_lens);
  const int64_t nnz = append_indptr.back();
  const ElemKind kind = q_kind(fdp);
  const ElemKind cache_kind = kv_kind(fdp, kind);
  Tensor* k_new = arena.make(kind, {nnz, hkv, dim}, false, small(fdp, 0, 2) * 8, 0);
  Tensor* v_new = arena.make(kind, {nnz, hkv, dim}, false, 0, small(fdp, 0, 2) * 8);
  Tensor* indptr = arena.ints(append_indptr);
  Paged paged = make_paged(arena, fdp, kv_lens, page_size, hkv, dim, cache_kind, true);
  const tessera_rope_options r = rope_options(fdp, dim);
  const bool with_rope = fdp.ConsumeBool();
  const int mutations = fdp.ConsumeIntegralInRange<int>(0, 3);
  for (int i = 0; i < mutations; ++i) arena.mutate();
  arena.finalize();
  const tessera_paged_kv kv = paged.kv();
  arena.check(tessera_append_paged_kv_cache(k_new->get(), v_new->get(), indptr->get(), &kv,
                                            with_rope ? &r : nullptr, nullptr));
}

void block_table(Arena& arena, FuzzedDataProvider& fdp) {
  const int batch = small(fdp, 0, 4), max_pages = small(fdp, 0, 5), page_size = small(fdp, -1, 8);
  std::vector<int32_t> table(static_cast<size_t>(batch) * max_pages), seq(batch);
  for (auto& t : table) t = small(fdp, -1, 20);
  for (auto& s : seq) s = small(fdp, -1, max_pages * std::max(page_size, 1) + 1);
  Tensor* bt = arena.ints(table);
  bt->t.ndim = 2;
  bt->shape[0] = batch;
  bt->shape[1] = max_pages;
  bt->strides[0] = max_pages;
  bt->strides[1] = 1;
  bt->explicit_strides = false;
  Tensor* seq_lens = arena.ints(seq);
  Tensor* indptr = arena.make(kI32, {batch + 1}, true);
  Tensor* indices = arena.make(kI32, {static_cast<int64_t>(table.size()) + small(fdp, -2, 2)}, true);
  Tensor* last = arena.make(kI32, {batch}, true);
  const int mutations = fdp.ConsumeIntegralInRange<int>(0, 3);
  for (int i = 0; i < mutations; ++i) arena.mutate();
  arena.finalize();
  arena.check(tessera_block_table_to_csr(bt->get(), seq_lens->get(), page_size, indptr->get(),
                                         indices->get(), last->get(), nullptr));
}

void merge(Arena& arena, FuzzedDataProvider& fdp) {
  const int64_t heads = small(fdp, 1, 3), dim = head_dim(fdp);
  const ElemKind kind = fdp.ConsumeBool() ? kF32 : q_kind(fdp);
  if (fdp.ConsumeBool()) {
    const int64_t n = small(fdp, 0, 5);
    Tensor* oa = arena.make(kind, {n, heads, dim}, false, small(fdp, 0, 1) * 8, 0);
    Tensor* la = arena.make(kF32, {n, heads}, false, small(fdp, 0, 2), 0);
    Tensor* ob = arena.make(kind, {n, heads, dim}, false, 0, small(fdp, 0, 1) * 8);
    Tensor* lb = arena.make(kF32, {n, heads}, false);
    Tensor* out = arena.make(q_kind(fdp), {n, heads, dim}, true, small(fdp, 0, 1) * 8, 0);
    Tensor* lout = fdp.ConsumeBool() ? arena.make(kF32, {n, heads}, true, small(fdp, 0, 2), 0) : nullptr;
    const int mutations = fdp.ConsumeIntegralInRange<int>(0, 3);
    for (int i = 0; i < mutations; ++i) arena.mutate();
    arena.finalize();
    arena.check(tessera_merge_state(oa->get(), la->get(), ob->get(), lb->get(), out->get(),
                                    lout ? lout->get() : nullptr, nullptr));
  } else {
    const int n = small(fdp, 0, 4);
    std::vector<int32_t> counts(n);
    for (auto& c : counts) c = small(fdp, 0, 3);
    const std::vector<int32_t> indptr = indptr_of(counts);
    const int64_t s = indptr.back() + small(fdp, 0, 1);
    Tensor* states = arena.make(kind, {s, heads, dim}, false, small(fdp, 0, 1) * 8, 0);
    Tensor* lse = arena.make(kF32, {s, heads}, false);
    Tensor* ip = arena.ints(indptr);
    Tensor* out = arena.make(q_kind(fdp), {n, heads, dim}, true, 0, small(fdp, 0, 1) * 8);
    Tensor* lout = fdp.ConsumeBool() ? arena.make(kF32, {n, heads}, true) : nullptr;
    const int mutations = fdp.ConsumeIntegralInRange<int>(0, 3);
    for (int i = 0; i < mutations; ++i) arena.mutate();
    arena.finalize();
    arena.check(tessera_merge_states(states->get(), lse->get(), ip->get(), out->get(),
                                     lout ? lout->get() : nullptr, nullptr));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider fdp(data, size);
  Arena arena;
  arena.fdp = &fdp;
  arena.seed = fdp.ConsumeIntegral<uint64_t>();
  const int threads = fdp.ConsumeIntegralInRange<int>(0, 7);
  // Mostly one thread (fast); sometimes 2, and the reference path.
  if (tessera_set_num_threads(threads == 7 ? 2 : 1) != TESSERA_OK) die("set_num_threads");
  if (tessera_set_cpu_reference(threads == 6) != TESSERA_OK) die("set_cpu_reference");
  switch (fdp.ConsumeIntegralInRange<int>(0, 9)) {
    case 0: rope(arena, fdp); break;
    case 1: append(arena, fdp); break;
    case 2: block_table(arena, fdp); break;
    case 3: merge(arena, fdp); break;
    default: attention(arena, fdp); break;
  }
  return 0;
}
