// GPU tests of the sm80 batch decode kernel (through the public plan_decode / run_decode with
// CUDA tensor views, and through hand-made plans) against the double-precision CPU reference.
// The CUDA auxiliary ops (RoPE, paged-KV append, block_table -> CSR, merge_state(s)) are tested
// in test_cuda_ops.cpp (split only to keep each file under 800 lines).
//
// Decode cases use the shared generator's buffers (tests/common/attention_testing.hpp): NaN in
// stride padding, spare pages and unused page tails, NaN-poisoned outputs before each run, so a
// stray read or write shows up. fp8 K/V cases compare against the reference computed on the very
// same fp8 values. Each case runs three plans: the public planner's, the real planner with
// split-KV forced, and a hand-made plan (odd q tiles, tiny key pieces, any worker count).
//
// Without a CUDA device every test skips. TESSERA_TEST_REDUCED=1 shrinks the suites; the
// Sanitizer* suites are a few small cases covering every code path, for
//   compute-sanitizer --tool memcheck test_cuda_decode_ops --gtest_filter='Sanitizer*'
// (also racecheck / synccheck). TESSERA_TEST_SEED reproduces another random run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/api_runner.hpp"
#include "common/attention_testing.hpp"
#include "common/gpu_test_support.hpp"
#include "core/backends.hpp"
#include "core/half.hpp"
#include "core/planner.hpp"
#include "core/workspace_layout.hpp"
#include "tessera/attention.hpp"
#include "tessera/ops.hpp"
#include "tessera/types.hpp"

#if defined(TESSERA_HAVE_CUDA)
#include <cuda_runtime.h>

#include "cuda/cuda_backend.hpp"
#endif

namespace tessera {
namespace {

#if defined(TESSERA_HAVE_CUDA)

using test::AttentionBuffers;
using test::AttentionCase;
using test::Outputs;
using test::options_of;
using test::run_reference;

using test::chance;
using test::DeviceBuffer;
using test::gpu_index_view;
using test::gpu_view;
using test::kGpu;
using test::pick;
using test::reduced_run;
using test::uniform;

constexpr double kOutputTolerance = 1e-2;  // relative L2 of o against the reference

uint64_t base_seed() {
  return test::seed_from_env(20251202ull);
}

// ============================================================================ decode

// Device copies of a decode case (byte for byte: NaN padding and spare pages included).
struct DeviceDecodeCase {
  const AttentionBuffers& host;
  DeviceBuffer q, k, v, o, lse, page_indptr, page_indices, last_page_len;
  test::BufferPointers pointers;

  explicit DeviceDecodeCase(const AttentionBuffers& buffers)
      : host(buffers),
        q(buffers.q),
        k(buffers.k),
        v(buffers.v),
        o(buffers.o),
        lse(buffers.lse),
        page_indptr(buffers.page_indptr),
        page_indices(buffers.page_indices),
        last_page_len(buffers.last_page_len) {
    pointers.q = q.data();
    pointers.k = k.data();
    pointers.v = v.data();
    pointers.o = o.data();
    pointers.lse = buffers.test_case.with_lse ? static_cast<float*>(lse.data()) : nullptr;
    pointers.page_indptr = static_cast<const int32_t*>(page_indptr.data());
    pointers.page_indices = static_cast<const int32_t*>(page_indices.data());
    pointers.last_page_len = static_cast<const int32_t*>(last_page_len.data());
  }

  void poison_outputs(AttentionBuffers& buffers) {
    test::poison_outputs(buffers);
    o.upload(buffers.o);
    lse.upload(buffers.lse);
  }
  Outputs download() const { return {o.download<uint8_t>(), lse.download<uint8_t>()}; }

  TensorView q_view() const {
    const AttentionCase& c = host.test_case;
    return gpu_view(q, c.q_dtype, {c.total_q(), c.num_qo_heads, c.head_dim},
                    {host.q_stride_token, host.q_stride_head, 1});
  }
  TensorView o_view() const {
    const AttentionCase& c = host.test_case;
    return gpu_view(o, c.q_dtype, {c.total_q(), c.num_qo_heads, c.head_dim},
                    {host.o_stride_token, host.o_stride_head, 1});
  }
  TensorView lse_view() const {
    const AttentionCase& c = host.test_case;
    if (!c.with_lse) return TensorView{};
    return gpu_view(lse, DType::kFloat32, {c.total_q(), c.num_qo_heads},
                    {host.lse_stride_token, 1});
  }
  PagedKVCache paged_cache() const {
    const AttentionCase& c = host.test_case;
    PagedKVCache cache;
    cache.layout = c.layout;
    for (auto [target, buffer] : {std::pair{&cache.k_cache, &k}, {&cache.v_cache, &v}}) {
      *target = c.layout == KVLayout::kNHD
                    ? gpu_view(*buffer, c.kv_dtype,
                               {host.num_pages, c.page_size, c.num_kv_heads, c.head_dim},
                               {host.kv_stride_page, host.kv_stride_token, host.kv_stride_head, 1})
                    : gpu_view(*buffer, c.kv_dtype,
                               {host.num_pages, c.num_kv_heads, c.page_size, c.head_dim},
                               {host.kv_stride_page, host.kv_stride_head, host.kv_stride_token, 1});
    }
    cache.page_indptr = gpu_index_view(page_indptr, c.batch_size() + 1);
    cache.page_indices =
        gpu_index_view(page_indices, static_cast<int64_t>(host.page_indices.size()));
    cache.last_page_len = gpu_index_view(last_page_len, c.batch_size());
    return cache;
  }
};

int32_t q_per_request(const AttentionCase& c) {
  return c.q_lens.empty() ? 1 : c.q_lens[0];
}

// A decode case: q_per_request tokens per request (speculative decoding when > 1), paged K/V.
AttentionCase decode_case(std::vector<int32_t> kv_lens, int32_t q_tokens, int32_t num_qo_heads,
                          int32_t num_kv_heads, int32_t head_dim, DType q_dtype, DType kv_dtype) {
  AttentionCase c;
  c.kv_lens = std::move(kv_lens);
  c.q_lens.assign(c.kv_lens.size(), q_tokens);
  c.uniform_q = true;
  c.paged = true;
  c.num_qo_heads = num_qo_heads;
  c.num_kv_heads = num_kv_heads;
  c.head_dim = head_dim;
  c.q_dtype = q_dtype;
  c.kv_dtype = kv_dtype;
  if (kv_dtype == DType::kFloat8E4M3 || kv_dtype == DType::kFloat8E5M2) {
    c.k_scale = 0.75f;
    c.v_scale = 1.5f;
  }
  return c;
}

// Keeps the double-precision reference cheap: halves key lengths until the case is small.
void limit_reference_cost(AttentionCase& c, int64_t max_macs) {
  auto macs = [&] {
    int64_t keys = 0;
    for (int32_t len : c.kv_lens) keys += len;
    return keys * q_per_request(c) * c.num_qo_heads * c.head_dim;
  };
  while (macs() > max_macs) {
    for (int32_t& len : c.kv_lens) len /= 2;
  }
}

struct DecodeCaseOptions {
  int32_t max_batch = 6;
  int32_t max_kv_len = 1200;
  int64_t max_reference_macs = 12'000'000;
};

AttentionCase random_decode_case(std::mt19937_64& rng, const DecodeCaseOptions& options) {
  const int32_t batch = uniform(rng, 1, options.max_batch);
  std::vector<int32_t> kv_lens(batch);
  for (int32_t& len : kv_lens) {
    const int32_t kind = uniform(rng, 0, 9);
    len = kind == 0 ? 0 : kind <= 2 ? uniform(rng, 1, 8) : uniform(rng, 1, options.max_kv_len);
  }
  const int32_t num_kv_heads = uniform(rng, 1, 3);
  const int32_t group = chance(rng, 0.1) ? pick<int32_t>(rng, {12, 16, 32}) : uniform(rng, 1, 8);
  const int32_t head_dim =
      chance(rng, 0.1) ? 8 * uniform(rng, 1, 32) : pick<int32_t>(rng, {64, 96, 128, 256});
  const DType q_dtype = chance(rng, 0.5) ? DType::kFloat16 : DType::kBFloat16;
  DType kv_dtype = q_dtype;
  if (chance(rng, 0.25)) kv_dtype = chance(rng, 0.5) ? DType::kFloat8E4M3 : DType::kFloat8E5M2;
  AttentionCase c = decode_case(std::move(kv_lens), uniform(rng, 1, 8), group * num_kv_heads,
                                num_kv_heads, head_dim, q_dtype, kv_dtype);
  if (kv_dtype != q_dtype) {
    c.k_scale = std::uniform_real_distribution<float>(0.25f, 2.0f)(rng);
    c.v_scale = std::uniform_real_distribution<float>(0.25f, 2.0f)(rng);
  }
  const int32_t page_kind = uniform(rng, 0, 3);
  c.page_size = page_kind == 0   ? 1
                : page_kind == 1 ? 16
                : page_kind == 2 ? 64
                                 : uniform(rng, 1, 128);
  c.layout = chance(rng, 0.5) ? KVLayout::kNHD : KVLayout::kHND;
  c.spare_pages = uniform(rng, 0, 3);
  c.causal = chance(rng, q_per_request(c) > 1 ? 0.6 : 0.3);
  if (chance(rng, 0.2)) {
    c.window_left = chance(rng, 0.8) ? uniform(rng, 0, 64) : -1;
    c.window_right = chance(rng, 0.5) ? uniform(rng, 0, 4) : -1;
  }
  if (chance(rng, 0.2)) c.soft_cap = std::uniform_real_distribution<float>(2.0f, 50.0f)(rng);
  if (chance(rng, 0.3)) c.sm_scale = std::uniform_real_distribution<float>(0.03f, 0.3f)(rng);
  c.with_lse = chance(rng, 0.8);
  const int32_t pad_kind = uniform(rng, 0, 5);
  if (pad_kind >= 3) {
    // Strided views: multiples of 16 elements keep 16-byte K/V rows (the cp.async fast path);
    // pad_kind 5 allows any padding, so K/V rows may be only 8-, 4-, 2- or 1-byte aligned.
    const int32_t unit = pad_kind == 5 ? 1 : 16;
    for (int32_t* pad : {&c.q_head_pad, &c.q_token_pad, &c.o_head_pad, &c.o_token_pad,
                         &c.kv_head_pad, &c.kv_token_pad}) {
      *pad = unit * uniform(rng, 0, 40 / unit + 1);
    }
    c.lse_token_pad = uniform(rng, 0, 5);
  }
  limit_reference_cost(c, options.max_reference_macs);
  return c;
}

// Runs `plan` through the public run_decode with a NaN-filled workspace.
Outputs run_public(AttentionBuffers& buffers, DeviceDecodeCase& device, const Plan& plan,
                   const RunOptions& run_options = {}) {
  device.poison_outputs(buffers);
  DeviceBuffer workspace(plan.workspace_bytes);
  detail::cuda_memset(workspace.data(), 0xff, workspace.bytes(), nullptr);
  run_decode(plan, device.q_view(), device.paged_cache(), device.o_view(), device.lse_view(),
             Workspace{workspace.data(), workspace.bytes()}, nullptr, run_options);
  detail::cuda_synchronize(nullptr);
  return device.download();
}

// The real planner with the device's decode knobs, split-KV forced (64-key pieces).
Plan forced_split_plan(const AttentionCase& c, int32_t num_workers) {
  detail::PlanShape shape;
  shape.op = AttentionOp::kDecode;
  shape.device = kGpu;
  shape.q_lens = c.q_lens;
  shape.kv_lens = c.kv_lens;
  shape.num_qo_heads = c.num_qo_heads;
  shape.num_kv_heads = c.num_kv_heads;
  shape.head_dim = c.head_dim;
  shape.page_size = c.page_size;
  shape.options = options_of(c);
  PlanConfig config = detail::cuda_plan_config(AttentionOp::kDecode, c.num_qo_heads, c.num_kv_heads,
                                               c.head_dim, c.kv_dtype, 0);
  config.split_kv = true;
  config.min_kv_chunk = detail::kSplitAlignment;
  config.num_workers = num_workers;
  return detail::make_plan(shape, config);
}

// A hand-made plan through the backend entry (cuda_run_attention uploads and dispatches).
Outputs run_hand_made(AttentionBuffers& buffers, DeviceDecodeCase& device,
                      const test::TestPlanOptions& options) {
  Plan plan = test::make_test_plan(buffers.test_case, options);
  plan.device = kGpu;
  plan.workspace_bytes = detail::WorkspaceLayout::of(plan).total;
  device.poison_outputs(buffers);
  DeviceBuffer workspace(plan.workspace_bytes);
  detail::cuda_memset(workspace.data(), 0xff, workspace.bytes(), nullptr);
  detail::cuda_run_attention(plan, test::make_problem(buffers, device.pointers),
                             Workspace{workspace.data(), workspace.bytes()}, nullptr);
  detail::cuda_synchronize(nullptr);
  return device.download();
}

void expect_close(const AttentionBuffers& buffers, const Outputs& actual, const Outputs& expected,
                  const std::string& run) {
  const test::Comparison result = test::compare_outputs(buffers, actual, expected);
  const AttentionCase& c = buffers.test_case;
  EXPECT_TRUE(result.ok(kOutputTolerance, test::default_lse_tolerance(c)))
      << result.describe() << "\n  case: " << c.describe() << "\n  run: " << run;
}

enum class PlanKinds { kAll, kPublicOnly };

void check_decode_case(const AttentionCase& c, std::mt19937_64& rng,
                       PlanKinds kinds = PlanKinds::kAll) {
  AttentionBuffers buffers = test::make_buffers(c, rng);
  const Outputs expected = run_reference(buffers);
  DeviceDecodeCase device(buffers);

  const Plan plan =
      plan_decode(buffers.page_indptr, buffers.last_page_len, c.page_size, c.num_qo_heads,
                  c.num_kv_heads, c.head_dim, options_of(c), kGpu, q_per_request(c));
  expect_close(buffers, run_public(buffers, device, plan), expected,
               "public plan, merges=" + std::to_string(plan.merges.size()));
  if (kinds == PlanKinds::kPublicOnly) return;

  const int32_t workers = uniform(rng, 1, 300);
  const Plan split = forced_split_plan(c, workers);
  expect_close(buffers, run_public(buffers, device, split), expected,
               "forced split-KV plan, workers=" + std::to_string(workers) +
                   " merges=" + std::to_string(split.merges.size()));

  test::TestPlanOptions hand_made;
  hand_made.q_tile_rows = pick<int32_t>(rng, {1, 8, 16, 64, 128});
  hand_made.kv_chunk = pick<int32_t>(rng, {0, 1, 17, 64, 100});
  hand_made.num_workers = uniform(rng, 1, 64);
  expect_close(buffers, run_hand_made(buffers, device, hand_made), expected,
               "hand-made plan q_tile_rows=" + std::to_string(hand_made.q_tile_rows) +
                   " kv_chunk=" + std::to_string(hand_made.kv_chunk) +
                   " workers=" + std::to_string(hand_made.num_workers));
}

void run_random_decode_suite(int cases, uint64_t seed, const DecodeCaseOptions& options) {
  std::mt19937_64 rng(seed);
  for (int i = 0; i < cases; ++i) {
    const AttentionCase c = random_decode_case(rng, options);
    SCOPED_TRACE("random decode case " + std::to_string(i) + " (seed " + std::to_string(seed) +
                 ")");
    check_decode_case(c, rng);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(CudaDecode, RandomCasesMatchReference) {
  TESSERA_SKIP_WITHOUT_GPU();
  // 120 random configurations x 3 plans: q_per_request 1..8, GQA 1..8 (and 12/16/32), head_dim
  // 64/96/128/256 or any multiple of 8, fp16/bf16 with same-dtype or fp8 K/V, page sizes
  // 1/16/64/random in NHD and HND, causal, windows, soft-cap, strided and misaligned views.
  run_random_decode_suite(reduced_run() ? 10 : 120, base_seed(), DecodeCaseOptions{});
}

TEST(CudaDecode, LongContextsSplitAcrossWorkers) {
  TESSERA_SKIP_WITHOUT_GPU();
  // One or two long requests: the public planner splits their keys over the device's workers
  // (the batch x kv_heads cannot fill it), so this is the split-KV + merge path at scale.
  DecodeCaseOptions options;
  options.max_batch = 2;
  options.max_kv_len = 9000;
  options.max_reference_macs = 40'000'000;
  run_random_decode_suite(reduced_run() ? 2 : 12, base_seed() + 1, options);
}

TEST(CudaDecode, GroupSizesHeadDimsAndQueryTokens) {
  TESSERA_SKIP_WITHOUT_GPU();
  // 8 GQA ratios (powers of two and not) x 4 head_dims x 3 query-token counts = 96 kernels'
  // worth of configurations: row slots of 1, 2 and 4 rows, one and several key partitions.
  std::mt19937_64 rng(base_seed() + 2);
  const std::vector<int32_t> head_dims = {64, 96, 128, 256};
  int index = 0;
  for (int32_t group = 1; group <= 8; ++group) {
    for (int32_t head_dim : head_dims) {
      for (int32_t q_tokens : {1, 3, 8}) {
        if (reduced_run() && index++ % 8 != 0) continue;
        const DType dtype = (group + head_dim / 32) % 2 == 0 ? DType::kBFloat16 : DType::kFloat16;
        AttentionCase c =
            decode_case({37, 300, 1, 129}, q_tokens, group * 2, 2, head_dim, dtype, dtype);
        c.page_size = 16;
        c.causal = q_tokens > 1;
        SCOPED_TRACE("group " + std::to_string(group) + " head_dim " + std::to_string(head_dim) +
                     " q_tokens " + std::to_string(q_tokens));
        check_decode_case(c, rng, PlanKinds::kPublicOnly);
      }
    }
  }
}

TEST(CudaDecode, Fp8KvCacheMatchesReferenceOnTheSameValues) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 3);
  for (DType kv_dtype : {DType::kFloat8E4M3, DType::kFloat8E5M2}) {
    for (DType q_dtype : {DType::kFloat16, DType::kBFloat16}) {
      // 72 and 200: rows of 8 x odd bytes end in a half-valid 16-byte chunk.
      for (int32_t head_dim : {64, 72, 128, 200, 256}) {
        AttentionCase c = decode_case({513, 64, 0, 1000}, 2, 8, 2, head_dim, q_dtype, kv_dtype);
        c.page_size = 16;
        c.causal = true;
        c.k_scale = 0.37f;
        c.v_scale = 2.5f;
        c.soft_cap = head_dim == 128 ? 30.0f : 0.0f;
        SCOPED_TRACE(std::string(dtype_name(kv_dtype)) + " head_dim " + std::to_string(head_dim));
        check_decode_case(c, rng);
      }
    }
  }
}

TEST(CudaDecode, RowsWithoutKeysGiveZeroAndMinusInf) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 4);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    // Empty requests, and causal rows that see nothing (q_per_request 6 > kv_len 2 or 3).
    AttentionCase c = decode_case({0, 2, 3, 0, 40}, 6, 8, 2, 128, dtype, dtype);
    c.causal = true;
    check_decode_case(c, rng);
    // Window (0, 0): a row sees only its diagonal key, and nothing when that key is before 0.
    c.window_left = 0;
    c.window_right = 0;
    check_decode_case(c, rng);
  }
}

TEST(CudaDecode, LargeItemsTakeSeveralRowPasses) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 5);
  // Items with more packed rows than a CTA pass holds (d256: 16, d128: 32, d64: 64 rows):
  // 8 tokens x group 8 at d256, group 32 x 2 tokens at d128, and a 96-head MQA group at d64,
  // which is larger than the 64-row tile on its own.
  AttentionCase c = decode_case({700, 33}, 8, 16, 2, 256, DType::kBFloat16, DType::kBFloat16);
  c.causal = true;
  check_decode_case(c, rng);
  check_decode_case(decode_case({400, 5}, 2, 32, 1, 128, DType::kFloat16, DType::kFloat16), rng);
  check_decode_case(decode_case({257}, 1, 96, 1, 64, DType::kBFloat16, DType::kFloat8E5M2), rng);
}

TEST(CudaDecode, MisalignedKvViewsUseNarrowerCopies) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 6);
  // Head padding of 4, 2 and 1 elements: K/V rows 8-, 4- and 2-byte aligned (fp16) or 4-, 2-
  // and 1-byte aligned (fp8): the 8-byte, 4-byte and synchronous copy paths.
  for (DType kv_dtype : {DType::kFloat16, DType::kFloat8E4M3}) {
    for (int32_t pad : {4, 2, 1}) {
      AttentionCase c = decode_case({90, 300}, 1, 4, 2, 128, DType::kFloat16, kv_dtype);
      c.layout = KVLayout::kNHD;
      c.page_size = 16;
      c.kv_head_pad = pad;
      SCOPED_TRACE(std::string(dtype_name(kv_dtype)) + " pad " + std::to_string(pad));
      check_decode_case(c, rng);
    }
  }
}

// Wide GQA groups and MQA (issue 39): items of 17..128 packed rows run on the tensor-core
// kernel's row-tile rows (2, 4 or 8 m16 row tiles sharing each K/V stage), every ratio with 1..8
// query tokens per request, fp16 and bf16, d64 and d128; the forced split and hand-made plans
// of check_decode_case cover the fused merge and other item heights.
TEST(CudaDecode, WideGroupsRunOnTensorCores) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 13);
  int index = 0;
  for (const int32_t group : {3, 6, 12, 16, 24, 32, 64, 128}) {
    for (const int32_t q_tokens : {1, 2, 5, 8}) {
      for (const int32_t head_dim : {64, 128}) {
        if (reduced_run() && index++ % 4 != 0) continue;
        const DType dtype = (group + q_tokens) % 2 == 0 ? DType::kBFloat16 : DType::kFloat16;
        const int32_t kv_heads = group >= 64 ? 1 : 2;
        AttentionCase c = decode_case({300, 1, 77, 1000}, q_tokens, group * kv_heads, kv_heads,
                                      head_dim, dtype, dtype);
        c.page_size = 16;
        c.causal = q_tokens > 1;
        SCOPED_TRACE("group " + std::to_string(group) + " q_tokens " + std::to_string(q_tokens) +
                     " head_dim " + std::to_string(head_dim));
        check_decode_case(c, rng);
        EXPECT_NE(std::string(detail::cuda_last_decode_kernel()).find("decode_mma_kernel<"),
                  std::string::npos)
            << detail::cuda_last_decode_kernel();
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

// Programmatic dependent launch (RunOptions::enable_pdl): the same bits as the ordinary launch
// on every kernel family (mma.sync narrow and row-tile rows, CUDA-core d256 and fp8, a split
// with the fused merge), back to back with a previous kernel still running (the first run's),
// and from a CUDA graph that chains two PDL launches.
TEST(CudaDecode, PdlLaunchMatchesTheOrdinaryOne) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 17);
  RunOptions pdl;
  pdl.enable_pdl = true;
  const AttentionCase cases[] = {
      decode_case({300, 1, 77, 4000}, 1, 32, 8, 128, DType::kBFloat16, DType::kBFloat16),
      decode_case({300, 77}, 2, 64, 1, 128, DType::kFloat16, DType::kFloat16),
      decode_case({300, 77}, 1, 16, 4, 256, DType::kBFloat16, DType::kBFloat16),
      decode_case({513, 64}, 1, 8, 2, 128, DType::kBFloat16, DType::kFloat8E4M3)};
  for (const AttentionCase& c : cases) {
    SCOPED_TRACE(c.describe());
    AttentionBuffers buffers = test::make_buffers(c, rng);
    const Outputs expected = run_reference(buffers);
    DeviceDecodeCase device(buffers);
    const Plan plan =
        plan_decode(buffers.page_indptr, buffers.last_page_len, c.page_size, c.num_qo_heads,
                    c.num_kv_heads, c.head_dim, options_of(c), kGpu, q_per_request(c));
    const Outputs ordinary = run_public(buffers, device, plan);
    const Outputs programmatic = run_public(buffers, device, plan, pdl);
    expect_close(buffers, programmatic, expected, "PDL launch");
    EXPECT_TRUE(programmatic.o == ordinary.o && programmatic.lse == ordinary.lse)
        << "the PDL launch changed bits";

    // Two PDL launches back to back in one captured graph (the second waits for the first).
    Plan uploaded = plan;
    DeviceBuffer workspace(plan.workspace_bytes);
    const Workspace space{workspace.data(), workspace.bytes()};
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    upload_plan(uploaded, space, stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    device.poison_outputs(buffers);
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    for (int i = 0; i < 2; ++i) {
      run_decode(uploaded, device.q_view(), device.paged_cache(), device.o_view(),
                 device.lse_view(), space, stream, pdl);
    }
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const Outputs replayed = device.download();
    EXPECT_TRUE(replayed.o == ordinary.o && replayed.lse == ordinary.lse)
        << "the graph of PDL launches changed bits";
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  }
}

TEST(SanitizerCudaDecode, SmallCasesEveryPath) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 7);
  const int32_t head_dims[] = {64, 128, 256};
  const DType kv_dtypes[] = {DType::kBFloat16, DType::kFloat8E4M3, DType::kFloat8E5M2};
  for (int i = 0; i < 6; ++i) {
    AttentionCase c = decode_case({70, 0, 33}, 1 + i % 3, (i % 3 + 1) * 2, 2, head_dims[i % 3],
                                  DType::kBFloat16, kv_dtypes[i % 3]);
    c.page_size = i % 2 == 0 ? 16 : 5;
    c.layout = i % 2 == 0 ? KVLayout::kNHD : KVLayout::kHND;
    c.causal = i >= 2;
    c.soft_cap = i == 4 ? 20.0f : 0.0f;
    c.kv_head_pad = i == 5 ? 1 : 0;
    SCOPED_TRACE("sanitizer decode case " + std::to_string(i));
    check_decode_case(c, rng);
  }  // A 32:1 and a 128:1 group: the row-tile rows of the tensor-core kernel.
  for (const int32_t group : {32, 128}) {
    SCOPED_TRACE("sanitizer wide group " + std::to_string(group));
    check_decode_case(decode_case({70, 0, 33}, 2, group, 1, 128, DType::kBFloat16,
                                  DType::kBFloat16),
                      rng);
  }
}

// More work items than persistent CTAs, of one to five key tiles each: every CTA runs several
// items, so the tensor-core kernel's cross-item prefetch (the next item's DecodeItem in shared
// memory after tile 0, its first tiles' key offsets after tile 1, or only the item when the
// current one has a single tile) is exercised; small enough for the sanitizers.
TEST(SanitizerCudaDecode, ManyItemsPerWorker) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 11);
  std::uniform_int_distribution<int32_t> short_len(1, 60), long_len(65, 300);
  for (const int32_t head_dim : {64, 128}) {
    std::vector<int32_t> lens(700);
    for (size_t i = 0; i < lens.size(); ++i) lens[i] = i % 4 == 0 ? short_len(rng) : long_len(rng);
    AttentionCase c = decode_case(lens, 1, 8, 2, head_dim, DType::kBFloat16, DType::kBFloat16);
    c.page_size = 16;
    c.layout = KVLayout::kNHD;
    SCOPED_TRACE("many items per worker, head_dim " + std::to_string(head_dim));
    check_decode_case(c, rng);
  }
}

// A batch of at least 2 (request, kv head) tiles per SM at head_dim bucket 128: the built-in
// default plans the small-CTA variant (core/tuning.hpp's batch rule) and run() launches it;
// other head_dims, plans of a fixed capacity and deterministic plans keep the light-batch
// variant. Results match either way.
TEST(CudaDecode, HeavyBatchesTakeTheSmallCtaVariant) {
  TESSERA_SKIP_WITHOUT_GPU();
  const int32_t num_kv_heads = 4;
  // The rule replaces only the built-in default: a variant from TESSERA_DECODE_VARIANT or a
  // tuning file entry (e.g. ~/.cache/tessera/tune.txt written by `tessera tune`) is kept.
  const auto variant_source = [&](int32_t head_dim) {
    return detail::cuda_decode_selection(num_kv_heads * 4, num_kv_heads, head_dim,
                                         DType::kBFloat16, detail::cuda_device_info(0))
        .tuning.variant_source;
  };
  if (variant_source(128) != detail::TuningSource::kDefault) {
    GTEST_SKIP() << "the d128 decode variant comes from the "
                 << detail::tuning_source_name(variant_source(128))
                 << ": the batch rule does not apply";
  }
  std::mt19937_64 rng(base_seed() + 12);
  const int32_t num_sms = detail::cuda_device_info(0).num_sms;
  const int32_t heavy = (detail::kHeavyBatchTilesPerSm * num_sms + num_kv_heads - 1) / num_kv_heads;
  for (const int32_t head_dim : {64, 128, 256}) {
    // Which kernel ran is checked only where the variant is the built-in default.
    const bool check_kernel =
        variant_source(head_dim) == detail::TuningSource::kDefault;
    for (const int32_t batch : {heavy - 1, heavy}) {
      std::vector<int32_t> lens(batch);
      for (int32_t& len : lens) len = uniform(rng, 1, 200);
      AttentionCase c =
          decode_case(lens, 1, num_kv_heads * 4, num_kv_heads, head_dim, DType::kBFloat16,
                      DType::kBFloat16);
      c.page_size = 16;
      SCOPED_TRACE("head_dim " + std::to_string(head_dim) + ", batch " + std::to_string(batch));
      AttentionBuffers buffers = test::make_buffers(c, rng);
      const Plan plan =
          plan_decode(buffers.page_indptr, buffers.last_page_len, c.page_size, c.num_qo_heads,
                      c.num_kv_heads, c.head_dim, options_of(c), kGpu, 1);
      const bool expect_heavy = batch >= heavy && head_dim == 128;
      EXPECT_EQ(plan.config.heavy_batch, expect_heavy);
      EXPECT_EQ(plan.kernel.find("heavy batch") != std::string::npos, expect_heavy)
          << plan.kernel;
      const PlanCapacity capacity = plan_capacity(AttentionOp::kDecode, batch, batch, 200,
                                                  c.num_qo_heads, c.num_kv_heads, head_dim, kGpu);
      const Plan fixed =
          plan_decode(buffers.page_indptr, buffers.last_page_len, c.page_size, c.num_qo_heads,
                      c.num_kv_heads, c.head_dim, options_of(c), kGpu, 1, capacity);
      EXPECT_FALSE(fixed.config.heavy_batch);
      PlanCapacity deterministic;
      deterministic.deterministic = true;
      EXPECT_FALSE(plan_decode(buffers.page_indptr, buffers.last_page_len, c.page_size,
                               c.num_qo_heads, c.num_kv_heads, c.head_dim, options_of(c), kGpu,
                               1, deterministic)
                       .config.heavy_batch);
      // The plan records the variant its workers were sized for, and run() launches it: the
      // 2-warp, 3-stage kernel for a heavy d128 batch, else the default 4-warp one (d256 has
      // only the CUDA-core kernel).
      EXPECT_EQ(plan.config.decode_variant,
                expect_heavy ? detail::kHeavyBatchDecodeVariant : fixed.config.decode_variant);
      const std::string variant_tag = head_dim > 128    ? "decode_kernel<"
                                      : expect_heavy ? "warps 2, stages 3"
                                                     : "warps 4, stages 3";
      const Outputs expected = run_reference(buffers);
      DeviceDecodeCase device(buffers);
      expect_close(buffers, run_public(buffers, device, plan), expected, "public plan");
      if (check_kernel) {
        EXPECT_NE(std::string(detail::cuda_last_decode_kernel()).find(variant_tag),
                  std::string::npos)
            << detail::cuda_last_decode_kernel();
      }
      expect_close(buffers, run_public(buffers, device, fixed), expected, "fixed capacity");
      if (check_kernel) {
        EXPECT_NE(std::string(detail::cuda_last_decode_kernel())
                      .find(head_dim > 128 ? "decode_kernel<" : "warps 4, stages 3"),
                  std::string::npos)
            << detail::cuda_last_decode_kernel();
      }
    }
  }
}

#else  // !TESSERA_HAVE_CUDA

TEST(CudaDecode, BuiltWithoutCuda) {
  GTEST_SKIP() << "no CUDA device: GPU tests skipped (this build has no CUDA backend)";
}

#endif

}  // namespace
}  // namespace tessera
