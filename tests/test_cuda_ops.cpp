// GPU tests of the CUDA auxiliary ops against their CPU implementations (src/cpu), both called
// through the public API (tessera/ops.hpp) on identical input bytes:
//  * RoPE (NeoX / GPT-J, partial rotary_dim, rope_scale, Llama 3.1) and the paged-KV append
//    with fused RoPE: same float arithmetic as the host (sin/cos in double of the float angle,
//    unfused multiply-adds), so results agree to the last bit except where the two double
//    sincos implementations round differently; the check allows one unit of the dtype.
//  * the append without RoPE and block_table -> CSR: bit-exact (same conversions, fp8 too);
//  * merge_state / merge_states: float on the GPU vs double on the host, -inf states, in place.
// Without a CUDA device every test skips; TESSERA_TEST_REDUCED=1 and the SanitizerCudaOps
// suite are the compute-sanitizer sets (see test_cuda_decode_ops.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "common/gpu_test_support.hpp"
#include "core/half.hpp"
#include "tessera/ops.hpp"
#include "tessera/types.hpp"

namespace tessera {
namespace {

#if defined(TESSERA_HAVE_CUDA)

using test::chance;
using test::DeviceBuffer;
using test::gpu_index_view;
using test::kGpu;
using test::pick;
using test::reduced_run;
using test::uniform;

uint64_t base_seed() {
  return test::seed_from_env(20251203ull);
}

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
const std::vector<DType> kFloatDtypes = {DType::kFloat32, DType::kFloat16, DType::kBFloat16};

// Host bytes of `elements` values of `dtype`, each normal(0, scale).
std::vector<uint8_t> random_tensor(std::mt19937_64& rng, DType dtype, int64_t elements,
                                   double scale) {
  std::vector<uint8_t> bytes(static_cast<size_t>(elements) * dtype_size(dtype));
  std::normal_distribution<double> normal(0.0, scale);
  for (int64_t i = 0; i < elements; ++i) {
    detail::store_from_float(bytes.data(), dtype, i, static_cast<float>(normal(rng)));
  }
  return bytes;
}

TensorView host_view(void* data, DType dtype, std::initializer_list<int64_t> shape,
                     std::initializer_list<int64_t> stride) {
  return make_view(data, dtype, shape, stride);
}
TensorView view_on(Device device, void* data, DType dtype, std::initializer_list<int64_t> shape,
                   std::initializer_list<int64_t> stride) {
  return make_view(data, dtype, shape, stride, device);
}

// Relative precision of one unit in the last place of a dtype.
double unit_of(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 0x1p-23;
    case DType::kFloat16: return 0x1p-10;
    case DType::kBFloat16: return 0x1p-7;
    case DType::kFloat8E4M3: return 0x1p-3;
    default: return 0x1p-2;  // e5m2
  }
}

// Every element equal bit for bit, or within `units` units of the dtype (relative) plus `floor`.
void expect_elements_close(const std::vector<uint8_t>& actual, const std::vector<uint8_t>& expected,
                           DType dtype, double units, double floor, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  const size_t bytes = dtype_size(dtype);
  int64_t bad = 0, first_bad = -1;
  for (size_t i = 0; i < actual.size() / bytes; ++i) {
    if (std::equal(actual.begin() + i * bytes, actual.begin() + (i + 1) * bytes,
                   expected.begin() + i * bytes)) {
      continue;
    }
    const double a = detail::load_as_float(actual.data(), dtype, static_cast<int64_t>(i));
    const double e = detail::load_as_float(expected.data(), dtype, static_cast<int64_t>(i));
    if (std::fabs(a - e) <= units * unit_of(dtype) * std::fabs(e) + floor) continue;
    if (bad++ == 0) first_bad = static_cast<int64_t>(i);
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " elements differ, first at " << first_bad;
}

// ============================================================================ RoPE

RopeOptions random_rope_options(std::mt19937_64& rng, int32_t head_dim) {
  RopeOptions options;
  options.rotary_dim = chance(rng, 0.5) ? 0 : 2 * uniform(rng, 1, head_dim / 2);
  options.interleave = chance(rng, 0.5);
  options.rope_theta = pick<float>(rng, {1e4f, 5e5f});
  options.rope_scale = chance(rng, 0.3) ? 2.5f : 1.0f;
  options.llama31 = chance(rng, 0.3);
  return options;
}

void check_rope_case(std::mt19937_64& rng, int32_t max_tokens) {
  const int32_t nnz = uniform(rng, 1, max_tokens);
  const int32_t q_heads = uniform(rng, 1, 8), k_heads = uniform(rng, 1, 4);
  const int32_t head_dim = pick<int32_t>(rng, {8, 64, 80, 128, 256});
  const DType q_dtype = pick(rng, kFloatDtypes), k_dtype = pick(rng, kFloatDtypes);
  const bool with_q = chance(rng, 0.85), with_k = !with_q || chance(rng, 0.85);
  const RopeOptions options = random_rope_options(rng, head_dim);
  // Token strides with padding: views into a larger buffer, the padding must stay untouched.
  const int64_t q_token_stride = int64_t{q_heads} * head_dim + uniform(rng, 0, 9);
  const int64_t k_token_stride = int64_t{k_heads} * head_dim + uniform(rng, 0, 9);
  std::vector<uint8_t> q = random_tensor(rng, q_dtype, nnz * q_token_stride, 1.0);
  std::vector<uint8_t> k = random_tensor(rng, k_dtype, nnz * k_token_stride, 1.0);
  std::vector<int32_t> positions(static_cast<size_t>(nnz));
  const int32_t max_position = chance(rng, 0.5) ? 300 : 1'000'000;
  for (int32_t& position : positions) position = uniform(rng, 0, max_position);

  DeviceBuffer q_device(q), k_device(k), positions_device(positions);
  auto views = [&](Device device, void* q_data, void* k_data) {
    const TensorView q_view = with_q ? view_on(device, q_data, q_dtype, {nnz, q_heads, head_dim},
                                               {q_token_stride, head_dim, 1})
                                     : TensorView{};
    const TensorView k_view = with_k ? view_on(device, k_data, k_dtype, {nnz, k_heads, head_dim},
                                               {k_token_stride, head_dim, 1})
                                     : TensorView{};
    return std::pair{q_view, k_view};
  };
  const auto [q_gpu, k_gpu] = views(kGpu, q_device.data(), k_device.data());
  apply_rope_inplace(q_gpu, k_gpu, gpu_index_view(positions_device, nnz), options, nullptr);
  const auto [q_cpu, k_cpu] = views(Device{}, q.data(), k.data());
  apply_rope_inplace(q_cpu, k_cpu, host_view(positions.data(), DType::kInt32, {nnz}, {1}), options,
                     nullptr);
  const std::string what =
      "rope nnz " + std::to_string(nnz) + " head_dim " + std::to_string(head_dim) + " rotary " +
      std::to_string(options.rotary_dim) + (options.interleave ? " interleave" : " neox") +
      (options.llama31 ? " llama31" : "");
  expect_elements_close(q_device.download<uint8_t>(), q, q_dtype, 1.0, 1e-6, what + " (q)");
  expect_elements_close(k_device.download<uint8_t>(), k, k_dtype, 1.0, 1e-6, what + " (k)");
}

TEST(CudaOps, RopeMatchesCpu) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed());
  for (int i = 0; i < (reduced_run() ? 6 : 60); ++i) {
    SCOPED_TRACE("rope case " + std::to_string(i));
    check_rope_case(rng, 200);
  }
}

// apply_rope_with_cos_sin_cache_inplace on the GPU against the CPU, on a random table (any
// values: the op only reads it), int32 and int64 positions; then an out-of-range position on
// the device: that token's rotated features are NaN, everything else as on the CPU.
void check_rope_table_case(std::mt19937_64& rng, int32_t max_tokens, bool out_of_range) {
  const int32_t nnz = uniform(rng, 1, max_tokens);
  const int32_t q_heads = uniform(rng, 1, 8), k_heads = uniform(rng, 1, 4);
  const int32_t head_dim = pick<int32_t>(rng, {8, 64, 128, 256});
  const int32_t rotary_dim = chance(rng, 0.5) ? head_dim : 2 * uniform(rng, 1, head_dim / 2);
  const int32_t max_position = uniform(rng, 1, 600);
  const DType q_dtype = pick(rng, kFloatDtypes), k_dtype = pick(rng, kFloatDtypes);
  const bool interleave = chance(rng, 0.5), wide = chance(rng, 0.5);
  std::vector<uint8_t> q = random_tensor(rng, q_dtype, int64_t{nnz} * q_heads * head_dim, 1.0);
  std::vector<uint8_t> k = random_tensor(rng, k_dtype, int64_t{nnz} * k_heads * head_dim, 1.0);
  std::vector<uint8_t> table_bytes =
      random_tensor(rng, DType::kFloat32, int64_t{max_position} * rotary_dim, 1.0);
  std::vector<int64_t> positions(static_cast<size_t>(nnz));
  for (int64_t& position : positions) position = uniform(rng, 0, max_position - 1);
  const int32_t bad_token = out_of_range ? uniform(rng, 0, nnz - 1) : -1;
  std::vector<int64_t> device_positions = positions;
  if (bad_token >= 0) device_positions[bad_token] = chance(rng, 0.5) ? max_position : -1;
  std::vector<int32_t> narrow(device_positions.begin(), device_positions.end());
  std::vector<int32_t> narrow_host(positions.begin(), positions.end());

  DeviceBuffer q_device(q), k_device(k), table_device(table_bytes);
  DeviceBuffer positions_device = wide ? DeviceBuffer(device_positions) : DeviceBuffer(narrow);
  const DType position_dtype = wide ? DType::kInt64 : DType::kInt32;
  auto q_view = [&](Device device, void* data) {
    return view_on(device, data, q_dtype, {nnz, q_heads, head_dim},
                   {q_heads * head_dim, head_dim, 1});
  };
  auto k_view = [&](Device device, void* data) {
    return view_on(device, data, k_dtype, {nnz, k_heads, head_dim},
                   {k_heads * head_dim, head_dim, 1});
  };
  apply_rope_with_cos_sin_cache_inplace(
      q_view(kGpu, q_device.data()), k_view(kGpu, k_device.data()),
      view_on(kGpu, positions_device.data(), position_dtype, {nnz}, {1}),
      view_on(kGpu, table_device.data(), DType::kFloat32, {max_position, rotary_dim},
              {rotary_dim, 1}),
      interleave, nullptr);
  std::vector<uint8_t> q_expected = q, k_expected = k;
  apply_rope_with_cos_sin_cache_inplace(
      q_view(Device{}, q_expected.data()), k_view(Device{}, k_expected.data()),
      wide ? host_view(positions.data(), DType::kInt64, {nnz}, {1})
           : host_view(narrow_host.data(), DType::kInt32, {nnz}, {1}),
      host_view(table_bytes.data(), DType::kFloat32, {max_position, rotary_dim}, {rotary_dim, 1}),
      interleave, nullptr);
  // The expected NaN of the out-of-range token's rotated features.
  if (bad_token >= 0) {
    for (auto [bytes, dtype, heads] :
         {std::tuple{&q_expected, q_dtype, q_heads}, {&k_expected, k_dtype, k_heads}}) {
      for (int32_t h = 0; h < heads; ++h) {
        for (int32_t d = 0; d < rotary_dim; ++d) {
          detail::store_from_float(bytes->data(), dtype,
                                   (int64_t{bad_token} * heads + h) * head_dim + d,
                                   std::numeric_limits<float>::quiet_NaN());
        }
      }
    }
  }
  const std::string what = "rope table nnz " + std::to_string(nnz) + " head_dim " +
                           std::to_string(head_dim) + " rotary " + std::to_string(rotary_dim) +
                           (interleave ? " interleave" : " neox") + (wide ? " int64" : " int32") +
                           (bad_token >= 0 ? " bad token " + std::to_string(bad_token) : "");
  const auto nan_equal = [](std::vector<uint8_t> bytes, DType dtype) {  // NaN payloads may differ
    for (size_t i = 0; i < bytes.size() / dtype_size(dtype); ++i) {
      if (std::isnan(detail::load_as_float(bytes.data(), dtype, static_cast<int64_t>(i)))) {
        detail::store_from_float(bytes.data(), dtype, static_cast<int64_t>(i), 0.0f);
      }
    }
    return bytes;
  };
  expect_elements_close(nan_equal(q_device.download<uint8_t>(), q_dtype),
                        nan_equal(q_expected, q_dtype), q_dtype, 1.0, 1e-6, what + " (q)");
  expect_elements_close(nan_equal(k_device.download<uint8_t>(), k_dtype),
                        nan_equal(k_expected, k_dtype), k_dtype, 1.0, 1e-6, what + " (k)");
}

TEST(CudaOps, RopeWithCosSinCacheMatchesCpu) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 7);
  for (int i = 0; i < (reduced_run() ? 6 : 40); ++i) {
    SCOPED_TRACE("rope table case " + std::to_string(i));
    check_rope_table_case(rng, 200, i % 4 == 3);
  }
}

// ============================================================================ append

struct AppendGeometry {
  KVLayout layout;
  int32_t page_size, heads, head_dim;
  int64_t stride_page, stride_token, stride_head, num_pages;
};

void check_append_case(std::mt19937_64& rng, int32_t max_batch, int32_t max_append) {
  const int32_t batch = uniform(rng, 1, max_batch);
  AppendGeometry g;
  g.layout = chance(rng, 0.5) ? KVLayout::kNHD : KVLayout::kHND;
  g.page_size = pick<int32_t>(rng, {1, 16, 64, uniform(rng, 2, 40)});
  g.heads = uniform(rng, 1, 4);
  g.head_dim = pick<int32_t>(rng, {64, 72, 128, 256});
  const DType cache_dtype = pick<DType>(rng, {DType::kFloat32, DType::kFloat16, DType::kBFloat16,
                                              DType::kFloat8E4M3, DType::kFloat8E5M2});
  const DType source_dtype = pick(rng, kFloatDtypes);
  const bool with_rope = chance(rng, 0.5);
  const RopeOptions rope = random_rope_options(rng, g.head_dim);

  // Lengths before and after the append; the page table describes the cache after it.
  std::vector<int32_t> append_indptr(batch + 1, 0), page_indptr(batch + 1, 0);
  std::vector<int32_t> last_page_len(batch, 0), pages_of(batch, 0);
  for (int32_t b = 0; b < batch; ++b) {
    const int32_t appended = chance(rng, 0.2) ? 0 : uniform(rng, 1, max_append);
    const int32_t kv_len = uniform(rng, 0, 100) + appended;
    append_indptr[b + 1] = append_indptr[b] + appended;
    pages_of[b] = (kv_len + g.page_size - 1) / g.page_size;
    page_indptr[b + 1] = page_indptr[b] + pages_of[b];
    last_page_len[b] = pages_of[b] == 0 ? 0 : kv_len - (pages_of[b] - 1) * g.page_size;
  }
  g.num_pages = page_indptr[batch] + 2;  // two spare pages nobody owns
  std::vector<int32_t> page_indices(static_cast<size_t>(g.num_pages));
  std::iota(page_indices.begin(), page_indices.end(), 0);
  std::shuffle(page_indices.begin(), page_indices.end(), rng);
  page_indices.resize(std::max<size_t>(1, static_cast<size_t>(page_indptr[batch])));

  const int32_t pad = chance(rng, 0.5) ? uniform(rng, 0, 5) : 0;
  if (g.layout == KVLayout::kNHD) {
    g.stride_head = g.head_dim + pad;
    g.stride_token = g.heads * g.stride_head + pad;
    g.stride_page = g.page_size * g.stride_token;
  } else {
    g.stride_token = g.head_dim + pad;
    g.stride_head = g.page_size * g.stride_token + pad;
    g.stride_page = g.heads * g.stride_head;
  }
  const int64_t cache_elements = g.num_pages * g.stride_page;
  const int32_t nnz = append_indptr[batch];
  const int64_t new_token_stride = int64_t{g.heads} * g.head_dim + pad;
  std::vector<uint8_t> k_cache = random_tensor(rng, cache_dtype, cache_elements, 1.0);
  std::vector<uint8_t> v_cache = random_tensor(rng, cache_dtype, cache_elements, 1.0);
  std::vector<uint8_t> k_new =
      random_tensor(rng, source_dtype, std::max(1, nnz) * new_token_stride, 2.0);
  std::vector<uint8_t> v_new =
      random_tensor(rng, source_dtype, std::max(1, nnz) * new_token_stride, 2.0);

  DeviceBuffer k_cache_device(k_cache), v_cache_device(v_cache), k_new_device(k_new),
      v_new_device(v_new), append_device(append_indptr), page_indptr_device(page_indptr),
      page_indices_device(page_indices), last_device(last_page_len);
  auto run = [&](Device device, void* k_cache_data, void* v_cache_data, void* k_new_data,
                 void* v_new_data, void* append_data, void* indptr_data, void* indices_data,
                 void* last_data) {
    PagedKVCache cache;
    cache.layout = g.layout;
    for (auto [target, data] :
         {std::pair{&cache.k_cache, k_cache_data}, {&cache.v_cache, v_cache_data}}) {
      *target =
          g.layout == KVLayout::kNHD
              ? view_on(device, data, cache_dtype, {g.num_pages, g.page_size, g.heads, g.head_dim},
                        {g.stride_page, g.stride_token, g.stride_head, 1})
              : view_on(device, data, cache_dtype, {g.num_pages, g.heads, g.page_size, g.head_dim},
                        {g.stride_page, g.stride_head, g.stride_token, 1});
    }
    cache.page_indptr = view_on(device, indptr_data, DType::kInt32, {batch + 1}, {1});
    cache.page_indices = view_on(device, indices_data, DType::kInt32,
                                 {static_cast<int64_t>(page_indices.size())}, {1});
    cache.last_page_len = view_on(device, last_data, DType::kInt32, {batch}, {1});
    const TensorView k_view = view_on(device, k_new_data, source_dtype, {nnz, g.heads, g.head_dim},
                                      {new_token_stride, g.head_dim, 1});
    const TensorView v_view = view_on(device, v_new_data, source_dtype, {nnz, g.heads, g.head_dim},
                                      {new_token_stride, g.head_dim, 1});
    append_paged_kv_cache(k_view, v_view,
                          view_on(device, append_data, DType::kInt32, {batch + 1}, {1}), cache,
                          with_rope ? &rope : nullptr, nullptr);
  };
  run(kGpu, k_cache_device.data(), v_cache_device.data(), k_new_device.data(), v_new_device.data(),
      append_device.data(), page_indptr_device.data(), page_indices_device.data(),
      last_device.data());
  detail::cuda_synchronize(nullptr);
  run(Device{}, k_cache.data(), v_cache.data(), k_new.data(), v_new.data(), append_indptr.data(),
      page_indptr.data(), page_indices.data(), last_page_len.data());

  const std::string what = std::string("append ") + dtype_name(source_dtype) + " -> " +
                           dtype_name(cache_dtype) + (with_rope ? " with rope" : "") +
                           " page_size " + std::to_string(g.page_size) + " head_dim " +
                           std::to_string(g.head_dim);
  // Without RoPE the conversions must be bit-exact; with it, one unit of the cache dtype.
  expect_elements_close(k_cache_device.download<uint8_t>(), k_cache, cache_dtype,
                        with_rope ? 1.0 : 0.0, with_rope ? 1e-6 : 0.0, what + " (k cache)");
  expect_elements_close(v_cache_device.download<uint8_t>(), v_cache, cache_dtype, 0.0, 0.0,
                        what + " (v cache)");
}

TEST(CudaOps, AppendPagedKvMatchesCpu) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 1);
  for (int i = 0; i < (reduced_run() ? 6 : 60); ++i) {
    SCOPED_TRACE("append case " + std::to_string(i));
    check_append_case(rng, 6, 40);
  }
}

// ============================================================================ block table

void check_block_table_case(std::mt19937_64& rng, int32_t batch, int32_t max_pages,
                            int32_t page_size) {
  std::vector<int32_t> seq_lens(static_cast<size_t>(batch));
  for (int32_t& len : seq_lens) {
    len = chance(rng, 0.15) ? 0 : uniform(rng, 1, max_pages * page_size);
  }
  const int64_t row_stride = max_pages + uniform(rng, 0, 3);
  std::vector<int32_t> table(static_cast<size_t>(batch * row_stride));
  for (int32_t& entry : table) entry = uniform(rng, 0, 1 << 20);
  const int64_t capacity = int64_t{batch} * max_pages;
  std::vector<int32_t> indptr(batch + 1, -7), indices(static_cast<size_t>(capacity), -7),
      last(static_cast<size_t>(batch), -7);

  DeviceBuffer table_device(table), lens_device(seq_lens), indptr_device(indptr),
      indices_device(indices), last_device(last);
  block_table_to_csr(
      test::gpu_view(table_device, DType::kInt32, {batch, max_pages}, {row_stride, 1}),
      gpu_index_view(lens_device, batch), page_size, gpu_index_view(indptr_device, batch + 1),
      gpu_index_view(indices_device, capacity), gpu_index_view(last_device, batch), nullptr);
  block_table_to_csr(host_view(table.data(), DType::kInt32, {batch, max_pages}, {row_stride, 1}),
                     host_view(seq_lens.data(), DType::kInt32, {batch}, {1}), page_size,
                     host_view(indptr.data(), DType::kInt32, {batch + 1}, {1}),
                     host_view(indices.data(), DType::kInt32, {capacity}, {1}),
                     host_view(last.data(), DType::kInt32, {batch}, {1}), nullptr);
  const std::vector<int32_t> gpu_indptr = indptr_device.download<int32_t>();
  EXPECT_EQ(gpu_indptr, indptr) << "page_indptr, batch " << batch;
  EXPECT_EQ(last_device.download<int32_t>(), last) << "last_page_len, batch " << batch;
  std::vector<int32_t> gpu_indices = indices_device.download<int32_t>();
  gpu_indices.resize(static_cast<size_t>(indptr[batch]));
  indices.resize(static_cast<size_t>(indptr[batch]));
  EXPECT_EQ(gpu_indices, indices) << "page_indices, batch " << batch;
}

TEST(CudaOps, BlockTableToCsrMatchesCpu) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 2);
  // Batches below, at and far above the 1024 threads of the scan CTA (70000: 69 requests per
  // thread), page sizes 1 .. 64.
  for (int32_t batch : {1, 7, 1024, 5000}) {
    check_block_table_case(rng, batch, uniform(rng, 1, 40), pick<int32_t>(rng, {1, 16, 64, 5}));
  }
  if (!reduced_run()) check_block_table_case(rng, 70000, 4, 16);
}

// ============================================================================ merge

// lse values: mostly ordinary, some -inf (empty states), some huge (no overflow allowed).
float random_lse(std::mt19937_64& rng) {
  if (chance(rng, 0.2)) return kMinusInf;
  if (chance(rng, 0.05)) return 8000.0f + static_cast<float>(uniform(rng, 0, 20));
  return std::normal_distribution<float>(0.0f, 3.0f)(rng);
}

void expect_lse_close(const std::vector<float>& actual, const std::vector<float>& expected,
                      const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    if (expected[i] == kMinusInf) {
      EXPECT_EQ(actual[i], kMinusInf) << what << " lse " << i;
    } else {
      EXPECT_NEAR(actual[i], expected[i], 1e-5 * std::max(1.0f, std::fabs(expected[i])))
          << what << " lse " << i;
    }
  }
}

void check_merge_state_case(std::mt19937_64& rng, int32_t max_rows) {
  const int32_t rows = uniform(rng, 1, max_rows), heads = uniform(rng, 1, 8);
  const int32_t dim = pick<int32_t>(rng, {40, 64, 128, 256});
  const DType a_dtype = pick(rng, kFloatDtypes), b_dtype = pick(rng, kFloatDtypes);
  const bool in_place = chance(rng, 0.3), with_lse_out = chance(rng, 0.7);
  const DType out_dtype = in_place ? a_dtype : pick(rng, kFloatDtypes);
  const int64_t head_stride = dim + uniform(rng, 0, 3);
  const int64_t row_stride = heads * head_stride + uniform(rng, 0, 3);
  const int64_t elements = rows * row_stride;
  std::vector<uint8_t> o_a = random_tensor(rng, a_dtype, elements, 1.0);
  std::vector<uint8_t> o_b = random_tensor(rng, b_dtype, elements, 1.0);
  std::vector<uint8_t> o_out = random_tensor(rng, out_dtype, elements, 1.0);
  std::vector<float> lse_a(static_cast<size_t>(rows * heads)), lse_b(lse_a.size());
  for (size_t i = 0; i < lse_a.size(); ++i) {
    lse_a[i] = random_lse(rng);
    lse_b[i] = random_lse(rng);
  }
  std::vector<float> lse_out(lse_a.size(), 12345.0f);

  DeviceBuffer a_device(o_a), b_device(o_b), out_device(o_out), lse_a_device(lse_a),
      lse_b_device(lse_b), lse_out_device(lse_out);
  auto o_view = [&](Device device, void* data, DType dtype) {
    return view_on(device, data, dtype, {rows, heads, dim}, {row_stride, head_stride, 1});
  };
  auto lse_view = [&](Device device, void* data) {
    return view_on(device, data, DType::kFloat32, {rows, heads}, {heads, 1});
  };
  void* gpu_out = in_place ? a_device.data() : out_device.data();
  merge_state(o_view(kGpu, a_device.data(), a_dtype), lse_view(kGpu, lse_a_device.data()),
              o_view(kGpu, b_device.data(), b_dtype), lse_view(kGpu, lse_b_device.data()),
              o_view(kGpu, gpu_out, out_dtype),
              with_lse_out ? lse_view(kGpu, lse_out_device.data()) : TensorView{}, nullptr);
  void* cpu_out = in_place ? o_a.data() : o_out.data();
  merge_state(o_view(Device{}, o_a.data(), a_dtype), lse_view(Device{}, lse_a.data()),
              o_view(Device{}, o_b.data(), b_dtype), lse_view(Device{}, lse_b.data()),
              o_view(Device{}, cpu_out, out_dtype),
              with_lse_out ? lse_view(Device{}, lse_out.data()) : TensorView{}, nullptr);
  const std::string what = std::string("merge_state ") + dtype_name(a_dtype) + "+" +
                           dtype_name(b_dtype) + "->" + dtype_name(out_dtype) +
                           (in_place ? " in place" : "");
  const DeviceBuffer& result = in_place ? a_device : out_device;
  expect_elements_close(result.download<uint8_t>(), in_place ? o_a : o_out, out_dtype, 1.0, 1e-5,
                        what);
  expect_lse_close(lse_out_device.download<float>(), lse_out, what);
}

void check_merge_states_case(std::mt19937_64& rng, int32_t max_rows) {
  const int32_t rows = uniform(rng, 1, max_rows), heads = uniform(rng, 1, 6);
  const int32_t dim = pick<int32_t>(rng, {64, 96, 128});
  const DType states_dtype = pick(rng, kFloatDtypes), out_dtype = pick(rng, kFloatDtypes);
  std::vector<int32_t> indptr(rows + 1, 0);
  for (int32_t n = 0; n < rows; ++n) {
    indptr[n + 1] = indptr[n] + (chance(rng, 0.15) ? 0 : uniform(rng, 1, 5));
  }
  const int32_t num_states = std::max(1, indptr[rows]);
  const int64_t state_stride = int64_t{heads} * dim + uniform(rng, 0, 3);
  std::vector<uint8_t> states = random_tensor(rng, states_dtype, num_states * state_stride, 1.0);
  std::vector<float> lse(static_cast<size_t>(num_states * heads));
  for (float& value : lse) value = random_lse(rng);
  std::vector<uint8_t> o_out = random_tensor(rng, out_dtype, int64_t{rows} * heads * dim, 1.0);
  std::vector<float> lse_out(static_cast<size_t>(rows * heads), 12345.0f);

  DeviceBuffer states_device(states), lse_device(lse), indptr_device(indptr), out_device(o_out),
      lse_out_device(lse_out);
  auto run = [&](Device device, void* states_data, void* lse_data, void* indptr_data,
                 void* out_data, void* lse_out_data) {
    merge_states(view_on(device, states_data, states_dtype, {num_states, heads, dim},
                         {state_stride, dim, 1}),
                 view_on(device, lse_data, DType::kFloat32, {num_states, heads}, {heads, 1}),
                 view_on(device, indptr_data, DType::kInt32, {rows + 1}, {1}),
                 view_on(device, out_data, out_dtype, {rows, heads, dim}, {heads * dim, dim, 1}),
                 view_on(device, lse_out_data, DType::kFloat32, {rows, heads}, {heads, 1}),
                 nullptr);
  };
  run(kGpu, states_device.data(), lse_device.data(), indptr_device.data(), out_device.data(),
      lse_out_device.data());
  run(Device{}, states.data(), lse.data(), indptr.data(), o_out.data(), lse_out.data());
  const std::string what = std::string("merge_states ") + dtype_name(states_dtype) + "->" +
                           dtype_name(out_dtype) + " rows " + std::to_string(rows);
  expect_elements_close(out_device.download<uint8_t>(), o_out, out_dtype, 1.0, 1e-5, what);
  expect_lse_close(lse_out_device.download<float>(), lse_out, what);
}

TEST(CudaOps, MergeStateMatchesCpu) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 3);
  for (int i = 0; i < (reduced_run() ? 6 : 60); ++i) {
    SCOPED_TRACE("merge_state case " + std::to_string(i));
    check_merge_state_case(rng, 64);
  }
}

TEST(CudaOps, MergeStatesMatchesCpu) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 4);
  for (int i = 0; i < (reduced_run() ? 6 : 60); ++i) {
    SCOPED_TRACE("merge_states case " + std::to_string(i));
    check_merge_states_case(rng, 64);
  }
}

// ============================================================================ sanitizer set

TEST(SanitizerCudaOps, SmallCasesEveryOp) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 5);
  for (int i = 0; i < 3; ++i) {
    check_rope_case(rng, 4);
    check_rope_table_case(rng, 4, true);
    check_append_case(rng, 2, 3);
    check_merge_state_case(rng, 3);
    check_merge_states_case(rng, 3);
  }
  check_block_table_case(rng, 3, 4, 16);
  check_block_table_case(rng, 1100, 2, 1);
}

#else  // !TESSERA_HAVE_CUDA

TEST(CudaOps, BuiltWithoutCuda) {
  GTEST_SKIP() << "no CUDA device: GPU tests skipped (this build has no CUDA backend)";
}

#endif

}  // namespace
}  // namespace tessera
