// Public entry points of the auxiliary ops: validate, then dispatch to the CPU or CUDA backend.
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/backends.hpp"
#include "core/device_backend.hpp"
#include "core/dispatch.hpp"
#include "core/mla_internal.hpp"
#include "core/paged_source.hpp"
#include "core/validate.hpp"
#include "tessera/backend.hpp"
#include "tessera/ops.hpp"

namespace tessera {
namespace {

using detail::ArgChecker;

// The GPU backend of a call whose device check_usable accepted (so there is one).
const detail::DeviceBackend& gpu() {
  return *detail::gpu_backend();
}

constexpr std::initializer_list<DType> kFloatDtypes = {DType::kFloat32, DType::kFloat16,
                                                       DType::kBFloat16};

bool on_cpu(const TensorView& view) {
  return view.device.type == DeviceType::kCPU;
}

// The CUDA RoPE kernels (standalone and fused into the append) keep the frequencies and the
// cos/sin of every pair in fixed tables of 128 pairs (kMaxRopePairs, cuda/ops/rope_common.cuh).
constexpr int64_t kMaxRotaryDim = 256;

// The op kernels index heads and features in 32 bits and the CPU merge keeps one row of double
// accumulators, so both are bounded (heads by detail::kMaxHeads, as attention's), head_dim well
// above any attention head (256; MLA 576).
constexpr int64_t kMaxOpHeadDim = 4096;

void check_head_extent(const ArgChecker& check, const TensorView& view, const char* name,
                       int heads_index, int head_dim_index) {
  check.require(view.shape[heads_index] <= detail::kMaxHeads, name, [&] {
    return "expected num_heads <= " + std::to_string(detail::kMaxHeads) + ", got " +
           std::to_string(view.shape[heads_index]);
  });
  check.require(view.shape[head_dim_index] <= kMaxOpHeadDim, name, [&] {
    return "expected head_dim <= " + std::to_string(kMaxOpHeadDim) + ", got " +
           std::to_string(view.shape[head_dim_index]);
  });
}

// Throws unless `view` is usable on `device` (CUDA present etc.).
void check_usable(const ArgChecker& check, Device device) {
  detail::check_device_usable(check, device);
}

void check_merge_operand(const ArgChecker& check, const TensorView& o, const char* o_name,
                         const TensorView& lse, const char* lse_name, int64_t rows, int64_t heads,
                         int64_t head_dim, Device device, bool is_output = false) {
  check.tensor(o, o_name, 3, "[N, num_heads, head_dim]");
  if (is_output) check.output(o, o_name);
  check.dtype_in(o, o_name, kFloatDtypes);
  check.device_is(o, o_name, device);
  check.dim_is(o, o_name, 0, rows, "N");
  check.dim_is(o, o_name, 1, heads, "num_heads");
  check.dim_is(o, o_name, 2, head_dim, "head_dim");
  if (lse_name == nullptr) return;
  check.tensor(lse, lse_name, 2, "[N, num_heads] of float32");
  check.dtype_is(lse, lse_name, DType::kFloat32);
  check.device_is(lse, lse_name, device);
  check.dim_is(lse, lse_name, 0, rows, "N");
  check.dim_is(lse, lse_name, 1, heads, "num_heads");
  check.require(lse.is_contiguous(), lse_name, "expected a contiguous tensor");
  if (is_output) check.output(lse, lse_name);
}

// The q / k of a RoPE op: at least one given, each [nnz, heads, head_dim] of a float dtype on
// one device with the same nnz and head_dim. Returns the first one given.
const TensorView& check_rope_targets(const ArgChecker& check, const TensorView& q,
                                     const TensorView& k) {
  check.require(has_value(q) || has_value(k), "q", "expected q or k (or both), got neither");
  const TensorView& first = has_value(q) ? q : k;
  check.tensor(first, has_value(q) ? "q" : "k", 3, "[nnz, num_heads, head_dim]");
  for (const auto& [view, name] : {std::pair{q, "q"}, {k, "k"}}) {
    if (!has_value(view)) continue;
    check.tensor(view, name, 3, "[nnz, num_heads, head_dim]");
    check_head_extent(check, view, name, 1, 2);
    check.dtype_in(view, name, kFloatDtypes);
    check.device_is(view, name, first.device);
    check.dim_is(view, name, 0, first.shape[0], "nnz, the token count of q/k");
    check.dim_is(view, name, 2, first.shape[2], "head_dim");
  }
  return first;
}

}  // namespace

void detail::check_rope_options(const ArgChecker& check, const RopeOptions& options,
                                int64_t head_dim) {
  const int64_t rotary = options.rotary_dim == 0 ? head_dim : options.rotary_dim;
  check.require(rotary >= 2 && rotary <= head_dim && rotary % 2 == 0, "rope.rotary_dim", [&] {
    return "expected an even value in [2, head_dim = " + std::to_string(head_dim) +
           "] (0 = head_dim), got " + std::to_string(options.rotary_dim);
  });
  check.require(rotary <= kMaxRotaryDim, "rope.rotary_dim", [&] {
    return "expected at most " + std::to_string(kMaxRotaryDim) +
           " rotated features (0 = head_dim), got " + std::to_string(rotary);
  });
  check.require(std::isfinite(options.rope_theta) && options.rope_theta > 0, "rope.rope_theta",
                "expected a finite value > 0");
  check.require(std::isfinite(options.rope_scale) && options.rope_scale > 0, "rope.rope_scale",
                "expected a finite value > 0");
  if (options.llama31) {
    check.require(options.llama31_factor > 0 && std::isfinite(options.llama31_factor),
                  "rope.llama31_factor", "expected a finite value > 0");
    check.require(std::isfinite(options.llama31_low_freq_factor) &&
                      std::isfinite(options.llama31_high_freq_factor) &&
                      options.llama31_low_freq_factor > 0 &&
                      options.llama31_high_freq_factor > options.llama31_low_freq_factor,
                  "rope.llama31_high_freq_factor",
                  "expected high_freq_factor > low_freq_factor > 0");
    check.require(options.llama31_original_max_position > 0, "rope.llama31_original_max_position",
                  "expected > 0");
  }
}

void detail::check_append_page_table(const ArgChecker& check, const int32_t* append, int64_t batch,
                                     int64_t nnz, const KVSource& cache, int64_t page_size,
                                     int64_t page_indices_len, int64_t num_pages,
                                     const char* rows_of) {
  check.indptr(std::span<const int32_t>(append, batch + 1), "append_indptr");
  check.require(append[batch] == nnz, "append_indptr", [&] {
    return "append_indptr[batch_size] = " + std::to_string(append[batch]) + " must equal the " +
           std::to_string(nnz) + " rows of " + rows_of;
  });
  const std::span<const int32_t> pages(cache.page_indptr, batch + 1);
  check.indptr(pages, "page_indptr");
  check.require(pages.back() <= page_indices_len, "page_indices",
                "page_indptr[batch_size] exceeds the length of page_indices");
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t request_pages = pages[b + 1] - pages[b];
    if (request_pages > 0) {
      check.require(cache.last_page_len[b] >= 1 && cache.last_page_len[b] <= page_size,
                    "last_page_len", [&] {
                      return "expected values in [1, page_size], got last_page_len[" +
                             std::to_string(b) + "] = " + std::to_string(cache.last_page_len[b]);
                    });
    }
    // KVSource::kv_len is int32: count in 64 bits first (attention rejects such requests too).
    const int64_t kv_len =
        request_pages == 0 ? 0 : (request_pages - 1) * page_size + cache.last_page_len[b];
    check.require(kv_len <= INT32_MAX, "page_indptr", [&] {
      return "request " + std::to_string(b) + " holds more than 2^31 - 1 keys";
    });
    check.require(kv_len >= append[b + 1] - append[b], "page_indptr", [&] {
      return "request " + std::to_string(b) + " appends " +
             std::to_string(append[b + 1] - append[b]) + " rows but its pages hold only " +
             std::to_string(kv_len) + " (the page table must describe the cache after the append)";
    });
  }
  for (int32_t i = 0; i < pages.back(); ++i) {
    const int32_t page = cache.page_indices[i];
    check.require(page >= 0 && page < num_pages, "page_indices", [&] {
      return "entry " + std::to_string(i) + " = " + std::to_string(page) +
             " is out of range [0, num_pages = " + std::to_string(num_pages) + ")";
    });
  }
}

void apply_rope_inplace(const TensorView& q, const TensorView& k, const TensorView& positions,
                        const RopeOptions& options, void* stream) {
  const ArgChecker check("apply_rope_inplace");
  const TensorView& first = check_rope_targets(check, q, k);
  const Device device = first.device;
  const int64_t nnz = first.shape[0], head_dim = first.shape[2];
  check.index_array(positions, "positions", nnz, device);
  detail::check_rope_options(check, options, head_dim);
  check_usable(check, device);
  if (on_cpu(first)) {
    detail::cpu_apply_rope(q, k, positions.ptr<const int32_t>(), options);
    return;
  }
  gpu().apply_rope(q, k, positions.ptr<const int32_t>(), options, stream);
}

void apply_rope_with_cos_sin_cache_inplace(const TensorView& q, const TensorView& k,
                                           const TensorView& positions,
                                           const TensorView& cos_sin_cache, bool interleave,
                                           void* stream) {
  const ArgChecker check("apply_rope_with_cos_sin_cache_inplace");
  const TensorView& first = check_rope_targets(check, q, k);
  const Device device = first.device;
  const int64_t nnz = first.shape[0], head_dim = first.shape[2];
  check.tensor(positions, "positions", 1, "[nnz] of int32 or int64");
  check.dtype_in(positions, "positions", {DType::kInt32, DType::kInt64});
  check.device_is(positions, "positions", device);
  check.dim_is(positions, "positions", 0, nnz, "nnz, the token count of q/k");
  check.tensor(cos_sin_cache, "cos_sin_cache", 2, "[max_position, rotary_dim] of float32");
  check.dtype_is(cos_sin_cache, "cos_sin_cache", DType::kFloat32);
  check.device_is(cos_sin_cache, "cos_sin_cache", device);
  const int64_t rotary_dim = cos_sin_cache.shape[1], max_position = cos_sin_cache.shape[0];
  check.require(
      rotary_dim >= 2 && rotary_dim % 2 == 0 && rotary_dim <= head_dim, "cos_sin_cache", [&] {
        return "expected an even rotary_dim (dim 1) in [2, head_dim = " + std::to_string(head_dim) +
               "], got shape " + detail::shape_string(cos_sin_cache);
      });
  check.require(max_position >= 1 || nnz == 0, "cos_sin_cache",
                "expected at least one position (dim 0)");
  check_usable(check, device);
  // Positions are read where the call can read them: the CPU's, or a device copy in checked mode.
  const bool host = on_cpu(first);
  if (host || index_checking()) {
    const std::vector<int64_t> values = detail::read_index_values(positions, stream);
    for (int64_t i = 0; i < nnz; ++i) {
      if (values[i] < 0 || values[i] >= max_position) {
        check.fail("positions", "positions[" + std::to_string(i) +
                                    "] = " + std::to_string(values[i]) + " is outside [0, " +
                                    std::to_string(max_position) + ") (the rows of cos_sin_cache)");
      }
    }
  }
  if (host) {
    detail::cpu_apply_rope_cos_sin_cache(q, k, positions, cos_sin_cache, interleave);
    return;
  }
  gpu().apply_rope_cos_sin_cache(q, k, positions, cos_sin_cache, interleave, stream);
}

void append_paged_kv_cache(const TensorView& k_new, const TensorView& v_new,
                           const TensorView& append_indptr, const PagedKVCache& kv,
                           const RopeOptions* rope, void* stream) {
  const ArgChecker check("append_paged_kv_cache");
  check.tensor(k_new, "k_new", 3, "[nnz, num_kv_heads, head_dim]");
  check_head_extent(check, k_new, "k_new", 1, 2);
  const Device device = k_new.device;
  check_usable(check, device);
  check.dtype_in(k_new, "k_new", kFloatDtypes);
  check.tensor(v_new, "v_new", 3, "[nnz, num_kv_heads, head_dim]");
  check.dtype_is(v_new, "v_new", k_new.dtype);
  check.device_is(v_new, "v_new", device);
  for (int d = 0; d < 3; ++d) check.dim_is(v_new, "v_new", d, k_new.shape[d], "shape of k_new");
  const bool nhd = kv.layout == KVLayout::kNHD;
  check.require(kv.layout == KVLayout::kNHD || kv.layout == KVLayout::kHND, "kv.layout",
                "expected NHD (0) or HND (1)");
  const int token_dim = nhd ? 1 : 2, head_index = nhd ? 2 : 1;
  for (const auto& [view, name] : {std::pair{kv.k_cache, "k_cache"}, {kv.v_cache, "v_cache"}}) {
    check.tensor(view, name, 4,
                 nhd ? "[num_pages, page_size, num_kv_heads, head_dim] (NHD)"
                     : "[num_pages, num_kv_heads, page_size, head_dim] (HND)");
    check.device_is(view, name, device);
    check.output(view, name);
    check.dtype_in(view, name,
                   {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kFloat8E4M3,
                    DType::kFloat8E5M2});
    check.dim_is(view, name, head_index, k_new.shape[1], "num_kv_heads of k_new");
    check.dim_is(view, name, 3, k_new.shape[2], "head_dim of k_new");
  }
  check.dtype_is(kv.v_cache, "v_cache", kv.k_cache.dtype);
  for (int d = 0; d < 4; ++d) {
    check.dim_is(kv.v_cache, "v_cache", d, kv.k_cache.shape[d], "shape of k_cache");
  }
  const int64_t page_size = kv.k_cache.shape[token_dim];
  check.require(page_size >= 1 && page_size <= INT32_MAX, "k_cache", [&] {
    return "expected page_size in [1, 2^31), got " + std::to_string(page_size);
  });
  check.index_array(append_indptr, "append_indptr", -1, device);
  const int64_t batch = append_indptr.shape[0] - 1;
  // Both backends take the batch size and request indices as int32.
  check.require(batch >= 0 && batch <= INT32_MAX, "append_indptr", [&] {
    return "expected batch_size + 1 in [1, 2^31] elements, got " +
           std::to_string(append_indptr.shape[0]);
  });
  check.index_array(kv.page_indptr, "page_indptr", batch + 1, device);
  check.index_array(kv.page_indices, "page_indices", -1, device);
  check.index_array(kv.last_page_len, "last_page_len", batch, device);
  if (rope) detail::check_rope_options(check, *rope, k_new.shape[2]);

  const detail::KVSource cache = detail::paged_kv_source(kv);

  if (on_cpu(k_new)) {
    // Host arrays can be checked completely before anything is written.
    const int32_t* append = append_indptr.ptr<const int32_t>();
    detail::check_append_page_table(check, append, batch, k_new.shape[0], cache, page_size,
                                    kv.page_indices.shape[0], kv.k_cache.shape[0], "k_new");
    detail::cpu_append_paged_kv(k_new, v_new, append, cache, static_cast<int32_t>(batch),
                                static_cast<int32_t>(k_new.shape[1]),
                                static_cast<int32_t>(k_new.shape[2]), rope);
    return;
  }
  gpu().append_paged_kv(k_new, v_new, append_indptr.ptr<const int32_t>(), cache,
                        static_cast<int32_t>(batch), static_cast<int32_t>(k_new.shape[1]),
                        static_cast<int32_t>(k_new.shape[2]), rope, stream);
}

void block_table_to_csr(const TensorView& block_table, const TensorView& seq_lens, int page_size,
                        const TensorView& page_indptr, const TensorView& page_indices,
                        const TensorView& last_page_len, void* stream) {
  const ArgChecker check("block_table_to_csr");
  check.tensor(block_table, "block_table", 2, "[batch_size, max_pages] of int32");
  check.dtype_is(block_table, "block_table", DType::kInt32);
  const Device device = block_table.device;
  check_usable(check, device);
  check.device_is(block_table, "block_table", device);
  const int64_t batch = block_table.shape[0], max_pages = block_table.shape[1];
  check.require(max_pages <= INT32_MAX, "block_table", [&] {
    return "expected max_pages < 2^31 columns, got " + std::to_string(max_pages);
  });
  check.require(page_size >= 1, "page_size",
                [&] { return "expected >= 1, got " + std::to_string(page_size); });
  check.index_array(seq_lens, "seq_lens", batch, device);
  check.index_array(page_indptr, "page_indptr", batch + 1, device);
  check.index_array(page_indices, "page_indices", -1, device);
  check.index_array(last_page_len, "last_page_len", batch, device);
  if (on_cpu(block_table)) {
    const int32_t* lens = seq_lens.ptr<const int32_t>();
    int64_t total_pages = 0;
    for (int64_t b = 0; b < batch; ++b) {
      check.require(lens[b] >= 0, "seq_lens", [&] {
        return "expected lengths >= 0, got seq_lens[" + std::to_string(b) +
               "] = " + std::to_string(lens[b]);
      });
      const int64_t pages = (static_cast<int64_t>(lens[b]) + page_size - 1) / page_size;
      check.require(pages <= max_pages, "seq_lens", [&] {
        return "seq_lens[" + std::to_string(b) + "] = " + std::to_string(lens[b]) + " needs " +
               std::to_string(pages) + " pages but block_table has " + std::to_string(max_pages) +
               " columns";
      });
      total_pages += pages;
      check.require(total_pages <= INT32_MAX, "seq_lens", [&] {
        return "requests 0.." + std::to_string(b) + " need " + std::to_string(total_pages) +
               " pages, more than page_indptr (int32) can count";
      });
    }
    check.require(total_pages <= page_indices.shape[0], "page_indices", [&] {
      return "expected room for " + std::to_string(total_pages) + " entries, got " +
             std::to_string(page_indices.shape[0]);
    });
    detail::cpu_block_table_to_csr(block_table, lens, page_size, page_indptr.ptr<int32_t>(),
                                   page_indices.ptr<int32_t>(), last_page_len.ptr<int32_t>());
    return;
  }
  // On the device seq_lens cannot be read: any row may fill all its columns, and the kernels'
  // running page count becomes page_indptr (int32).
  check.require(max_pages == 0 || batch <= INT32_MAX / max_pages, "block_table", [&] {
    return "expected batch_size x max_pages <= 2^31 - 1 (page_indptr is int32), got " +
           std::to_string(batch) + " x " + std::to_string(max_pages);
  });
  check.require(page_indices.shape[0] >= batch * max_pages, "page_indices", [&] {
    return "expected room for batch_size x max_pages = " + std::to_string(batch * max_pages) +
           " entries, got " + std::to_string(page_indices.shape[0]);
  });
  gpu().block_table_to_csr(block_table, seq_lens.ptr<const int32_t>(), page_size,
                           page_indptr.ptr<int32_t>(), page_indices.ptr<int32_t>(),
                           last_page_len.ptr<int32_t>(), stream);
}

void merge_state(const TensorView& o_a, const TensorView& lse_a, const TensorView& o_b,
                 const TensorView& lse_b, const TensorView& o_out, const TensorView& lse_out,
                 void* stream) {
  const ArgChecker check("merge_state");
  check.tensor(o_a, "o_a", 3, "[N, num_heads, head_dim]");
  check_head_extent(check, o_a, "o_a", 1, 2);
  const Device device = o_a.device;
  check_usable(check, device);
  const int64_t rows = o_a.shape[0], heads = o_a.shape[1], dim = o_a.shape[2];
  check_merge_operand(check, o_a, "o_a", lse_a, "lse_a", rows, heads, dim, device);
  check_merge_operand(check, o_b, "o_b", lse_b, "lse_b", rows, heads, dim, device);
  check_merge_operand(check, o_out, "o_out", lse_out, has_value(lse_out) ? "lse_out" : nullptr,
                      rows, heads, dim, device, /*is_output=*/true);
  float* lse_out_ptr = has_value(lse_out) ? lse_out.ptr<float>() : nullptr;
  if (on_cpu(o_a)) {
    detail::cpu_merge_state(o_a, lse_a.ptr<const float>(), o_b, lse_b.ptr<const float>(), o_out,
                            lse_out_ptr);
    return;
  }
  gpu().merge_state(o_a, lse_a.ptr<const float>(), o_b, lse_b.ptr<const float>(), o_out,
                    lse_out_ptr, stream);
}

void merge_states(const TensorView& states, const TensorView& lse, const TensorView& indptr,
                  const TensorView& o_out, const TensorView& lse_out, void* stream) {
  const ArgChecker check("merge_states");
  check.tensor(states, "states", 3, "[num_states, num_heads, head_dim]");
  check_head_extent(check, states, "states", 1, 2);
  const Device device = states.device;
  check_usable(check, device);
  const int64_t num_states = states.shape[0], heads = states.shape[1], dim = states.shape[2];
  check_merge_operand(check, states, "states", lse, "lse", num_states, heads, dim, device);
  check.index_array(indptr, "indptr", -1, device);
  const int64_t rows = indptr.shape[0] - 1;
  check.require(rows >= 0, "indptr", "expected N + 1 >= 1 elements");
  check_merge_operand(check, o_out, "o_out", lse_out, has_value(lse_out) ? "lse_out" : nullptr,
                      rows, heads, dim, device, /*is_output=*/true);
  float* lse_out_ptr = has_value(lse_out) ? lse_out.ptr<float>() : nullptr;
  if (on_cpu(states)) {
    const int64_t last =
        check.indptr(std::span<const int32_t>(indptr.ptr<const int32_t>(), rows + 1), "indptr");
    check.require(last <= num_states, "indptr", [&] {
      return "indptr[N] = " + std::to_string(last) + " exceeds the " + std::to_string(num_states) +
             " states";
    });
    detail::cpu_merge_states(states, lse.ptr<const float>(), indptr.ptr<const int32_t>(), o_out,
                             lse_out_ptr);
    return;
  }
  gpu().merge_states(states, lse.ptr<const float>(), indptr.ptr<const int32_t>(), o_out,
                     lse_out_ptr, stream);
}

}  // namespace tessera
