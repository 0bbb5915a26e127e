// GPU tests of the prefill kernels (ragged and paged) and the split-KV merge, against the
// double-precision CPU reference. Every case runs three plans: the public planner's, the real
// planner with forced split-KV (tiny min_kv_chunk, many workers), and a hand-made plan with
// arbitrary q tiles, key pieces and worker counts through the backend entry directly. On a
// Hopper GPU those run the sm90 kernels (checked: the test fails if a case the sm90 kernels
// should serve ran elsewhere) and the public plan runs once more on the portable sm80 kernels
// (TESSERA_PREFILL_KERNEL=sm80), so both families are checked on every case.
//
// Without a CUDA device every test skips. TESSERA_TEST_REDUCED=1 shrinks the random suites;
// the CudaPrefillSanitizer suite is a handful of small cases for
//   compute-sanitizer --tool memcheck test_cuda_prefill --gtest_filter='CudaPrefillSanitizer.*'
// (also racecheck / synccheck). TESSERA_TEST_SEED reproduces another random run.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <iterator>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/api_runner.hpp"
#include "common/attention_testing.hpp"
#include "common/gpu_test_support.hpp"
#include "common/scoped_env.hpp"
#include "core/backends.hpp"
#include "core/planner.hpp"
#include "core/workspace_layout.hpp"
#include "tessera/attention.hpp"
#include "tessera/backend.hpp"
#include "tessera/types.hpp"

#if defined(TESSERA_HAVE_CUDA)
#include "core/half.hpp"
#include "cuda/cuda_backend.hpp"
#include "core/settings.hpp"
#include "cuda/kernel_registry.hpp"
#endif

namespace tessera {
namespace {

#if defined(TESSERA_HAVE_CUDA)

using test::AttentionBuffers;
using test::AttentionCase;
using test::Comparison;
using test::Outputs;
using test::options_of;
using test::run_reference;

using test::DeviceBuffer;
using test::kGpu;
using test::reduced_run;

// The brief's bar for fp16/bf16 outputs (P is rounded to the input dtype before P x V, as in
// FlashAttention-2, so bf16 cases are looser than the CPU fast path's float P).
constexpr double kOutputTolerance = 1e-2;

uint64_t base_seed() { return test::seed_from_env(20240917ull); }

// Device copies of a case's buffers (byte for byte: NaN padding and spare pages included).
struct DeviceCase {
  const AttentionBuffers& host;
  DeviceBuffer q, k, v, o, lse, qo_indptr, kv_indptr, page_indptr, page_indices, last_page_len;
  test::BufferPointers pointers;

  explicit DeviceCase(const AttentionBuffers& buffers)
      : host(buffers),
        q(buffers.q),
        k(buffers.k),
        v(buffers.v),
        o(buffers.o),
        lse(buffers.lse),
        qo_indptr(buffers.qo_indptr),
        kv_indptr(buffers.kv_indptr),
        page_indptr(buffers.page_indptr),
        page_indices(buffers.page_indices),
        last_page_len(buffers.last_page_len) {
    pointers.q = q.data();
    pointers.k = k.data();
    pointers.v = v.data();
    pointers.o = o.data();
    pointers.lse = buffers.test_case.with_lse ? static_cast<float*>(lse.data()) : nullptr;
    pointers.qo_indptr = static_cast<const int32_t*>(qo_indptr.data());
    pointers.kv_indptr = static_cast<const int32_t*>(kv_indptr.data());
    pointers.page_indptr = static_cast<const int32_t*>(page_indptr.data());
    pointers.page_indices = static_cast<const int32_t*>(page_indices.data());
    pointers.last_page_len = static_cast<const int32_t*>(last_page_len.data());
  }

  // NaN-poisoned outputs on the device (the host buffers are poisoned first).
  void poison_outputs(AttentionBuffers& buffers) {
    test::poison_outputs(buffers);
    o.upload(buffers.o);
    lse.upload(buffers.lse);
  }

  Outputs download() const {
    Outputs out{std::vector<uint8_t>(o.bytes()), std::vector<uint8_t>(lse.bytes())};
    detail::cuda_copy_to_host(out.o.data(), o.data(), o.bytes(), nullptr);
    detail::cuda_copy_to_host(out.lse.data(), lse.data(), lse.bytes(), nullptr);
    return out;
  }

  // ---- public-API views ----
  TensorView view(const DeviceBuffer& buffer, DType dtype, std::initializer_list<int64_t> shape,
                  std::initializer_list<int64_t> stride) const {
    return make_view(buffer.data(), dtype, shape, stride, kGpu);
  }
  TensorView index_view(const DeviceBuffer& buffer, int64_t count) const {
    return make_view(buffer.data(), DType::kInt32, {count}, kGpu);
  }
  TensorView q_view() const {
    const AttentionCase& c = host.test_case;
    return view(q, c.q_dtype, {c.total_q(), c.num_qo_heads, c.head_dim},
                {host.q_stride_token, host.q_stride_head, 1});
  }
  TensorView o_view() const {
    const AttentionCase& c = host.test_case;
    return view(o, c.q_dtype, {c.total_q(), c.num_qo_heads, c.head_dim},
                {host.o_stride_token, host.o_stride_head, 1});
  }
  TensorView lse_view() const {
    const AttentionCase& c = host.test_case;
    if (!c.with_lse) return TensorView{};
    return view(lse, DType::kFloat32, {c.total_q(), c.num_qo_heads}, {host.lse_stride_token, 1});
  }
  TensorView ragged_kv_view(const DeviceBuffer& buffer) const {
    const AttentionCase& c = host.test_case;
    return view(buffer, c.kv_dtype, {c.total_kv(), c.num_kv_heads, c.head_dim},
                {host.kv_stride_token, host.kv_stride_head, 1});
  }
  PagedKVCache paged_cache() const {
    const AttentionCase& c = host.test_case;
    PagedKVCache cache;
    cache.layout = c.layout;
    for (auto [target, buffer] : {std::pair{&cache.k_cache, &k}, {&cache.v_cache, &v}}) {
      *target =
          c.layout == KVLayout::kNHD
              ? view(*buffer, c.kv_dtype, {host.num_pages, c.page_size, c.num_kv_heads, c.head_dim},
                     {host.kv_stride_page, host.kv_stride_token, host.kv_stride_head, 1})
              : view(*buffer, c.kv_dtype, {host.num_pages, c.num_kv_heads, c.page_size, c.head_dim},
                     {host.kv_stride_page, host.kv_stride_head, host.kv_stride_token, 1});
    }
    cache.page_indptr = index_view(page_indptr, c.batch_size() + 1);
    cache.page_indices = index_view(page_indices, static_cast<int64_t>(host.page_indices.size()));
    cache.last_page_len = index_view(last_page_len, c.batch_size());
    return cache;
  }
};

// Uniform (decode-style) queries over a paged cache still take the prefill kernels here.
AttentionOp prefill_op_of(const AttentionCase& c) {
  return c.paged ? AttentionOp::kPagedPrefill : AttentionOp::kRaggedPrefill;
}

// The plan the public API makes for this case on the GPU.
Plan public_plan(const AttentionBuffers& buffers) {
  const AttentionCase& c = buffers.test_case;
  if (!c.paged) {
    return plan_ragged_prefill(buffers.qo_indptr, buffers.kv_indptr, c.num_qo_heads, c.num_kv_heads,
                               c.head_dim, options_of(c), kGpu);
  }
  return plan_paged_prefill(buffers.qo_indptr, buffers.page_indptr, buffers.last_page_len,
                            c.page_size, c.num_qo_heads, c.num_kv_heads, c.head_dim, options_of(c),
                            kGpu);
}

// The real planner with the device's knobs, but split-KV forced: small key pieces and many
// workers, so most key ranges are split and merged.
Plan forced_split_plan(const AttentionCase& c, int32_t num_workers) {
  detail::PlanShape shape;
  shape.op = prefill_op_of(c);
  shape.device = kGpu;
  shape.q_lens = c.q_lens;
  shape.kv_lens = c.kv_lens;
  shape.num_qo_heads = c.num_qo_heads;
  shape.num_kv_heads = c.num_kv_heads;
  shape.head_dim = c.head_dim;
  shape.page_size = c.paged ? c.page_size : 0;
  shape.options = options_of(c);
  PlanConfig config = detail::cuda_plan_config(shape.op, c.num_qo_heads, c.num_kv_heads, c.head_dim,
                                               c.kv_dtype, kGpu.index);
  config.split_kv = true;
  config.min_kv_chunk = detail::kSplitAlignment;
  config.num_workers = num_workers;
  return detail::make_plan(shape, config);
}

// Runs `plan` through run_ragged_prefill / run_paged_prefill with a NaN-filled workspace.
Outputs run_public(AttentionBuffers& buffers, DeviceCase& device, const Plan& plan,
                   const RunOptions& run_options = {}) {
  device.poison_outputs(buffers);
  DeviceBuffer workspace(plan.workspace_bytes);
  detail::cuda_memset(workspace.data(), 0xff, workspace.bytes(), nullptr);
  const Workspace space{workspace.data(), workspace.bytes()};
  const AttentionCase& c = buffers.test_case;
  if (!c.paged) {
    run_ragged_prefill(plan, device.q_view(), device.ragged_kv_view(device.k),
                       device.ragged_kv_view(device.v),
                       device.index_view(device.qo_indptr, c.batch_size() + 1),
                       device.index_view(device.kv_indptr, c.batch_size() + 1), device.o_view(),
                       device.lse_view(), space, nullptr, run_options);
  } else {
    run_paged_prefill(plan, device.q_view(), device.paged_cache(),
                      device.index_view(device.qo_indptr, c.batch_size() + 1), device.o_view(),
                      device.lse_view(), space, nullptr, run_options);
  }
  detail::cuda_synchronize(nullptr);
  return device.download();
}

// Runs a hand-made plan (arbitrary q tiles, key pieces, workers) through the backend entry.
Outputs run_hand_made(AttentionBuffers& buffers, DeviceCase& device,
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

// The first rows whose output differs from the reference, 8 values each (a failure's pattern:
// zeros, NaN, a transposed or shifted tile, one bad head).
std::string first_bad_rows(const AttentionBuffers& buffers, const Outputs& actual,
                           const Outputs& expected) {
  const AttentionCase& c = buffers.test_case;
  std::ostringstream text;
  int shown = 0;
  for (int64_t token = 0; token < c.total_q() && shown < 3; ++token) {
    for (int32_t h = 0; h < c.num_qo_heads && shown < 3; ++h) {
      const int64_t base = token * buffers.o_stride_token + h * buffers.o_stride_head;
      double worst = 0.0;
      for (int32_t d = 0; d < c.head_dim; ++d) {
        const double out = detail::load_as_float(actual.o.data(), c.q_dtype, base + d);
        const double ref = detail::load_as_float(expected.o.data(), c.q_dtype, base + d);
        worst = std::isfinite(out) ? std::max(worst, std::fabs(out - ref)) : 1e30;
      }
      if (worst < 0.05) continue;
      if (shown++ == 0) text << "\n  first bad rows (out/ref):";
      text << "\n  token " << token << " head " << h << ":";
      for (int32_t d = 0; d < std::min(c.head_dim, 8); ++d) {
        text << " " << detail::load_as_float(actual.o.data(), c.q_dtype, base + d) << "/"
             << detail::load_as_float(expected.o.data(), c.q_dtype, base + d);
      }
    }
  }
  return text.str();
}

void expect_close(const AttentionBuffers& buffers, const Outputs& actual, const Outputs& expected,
                  const std::string& run) {
  const Comparison result = test::compare_outputs(buffers, actual, expected);
  const AttentionCase& c = buffers.test_case;
  const bool ok = result.ok(kOutputTolerance, test::default_lse_tolerance(c));
  EXPECT_TRUE(ok) << result.describe() << "\n  case: " << c.describe() << "\n  run: " << run
                  << "\n  kernel: " << detail::cuda_last_prefill_kernel()
                  << (ok ? std::string() : first_bad_rows(buffers, actual, expected));
}

// Whether the sm90 kernels should serve this case on device 0, restated from their limits:
// Hopper, TESSERA_PREFILL_KERNEL not sm80, fp16/bf16 q with K/V of its dtype, head_dim up to
// 256 and a GQA group within the 128-row tile.
bool sm90_serves(const AttentionCase& c) {
  const detail::CudaDeviceInfo& info = detail::cuda_device_info(kGpu.index);
  const bool half = c.q_dtype == DType::kFloat16 || c.q_dtype == DType::kBFloat16;
  return info.sm_major == 9 && !detail::settings().prefill_force_sm80 && half &&
         c.kv_dtype == c.q_dtype && c.head_dim <= 256 && c.num_qo_heads / c.num_kv_heads <= 128;
}

// The page layout tag of the sm90 kernel that should serve a case (prefill_kernel_name), from
// the dispatch rule restated here: d128 over pages shorter than a key tile gets V page by page
// ; "" for the rest.
std::string expected_page_tag(const AttentionCase& c) {
  if (!c.paged || c.head_dim != 128) return "";
  return c.page_size < 128 ? ", paged V" : "";
}

// The kernel family the last launch used, when the plan launched anything; for the sm90 family
// also its page layout.
void expect_family(const AttentionCase& c, const Plan& plan, const char* prefix,
                   const std::string& run) {
  if (plan.work.empty()) return;
  const std::string kernel = detail::cuda_last_prefill_kernel();
  // The plan's registry row is what ran, unless run() recorded a fallback.
  if (plan.kernel_id >= 0 && *detail::cuda_last_prefill_fallback() == '\0') {
    const detail::KernelInstance* chosen =
        detail::kernel_row(plan.kernel_id).instance(c.q_dtype, c.kv_dtype);
    ASSERT_NE(chosen, nullptr) << plan.kernel;
    EXPECT_EQ(kernel, chosen->name) << plan.kernel << "\n  run: " << run;
  }
  EXPECT_EQ(kernel.rfind(prefix, 0), 0u)
      << "expected a " << prefix << " kernel, ran " << kernel << "\n  case: " << c.describe()
      << "\n  run: " << run;
  if (std::string(prefix) != "tessera::sm90::") return;
  const std::string tag = expected_page_tag(c);
  const bool tagged = !tag.empty() && kernel.find(tag) != std::string::npos;
  const bool untagged = tag.empty() && kernel.find(", paged") == std::string::npos;
  EXPECT_TRUE(tagged || untagged) << "expected the sm90 kernel" << (tag.empty() ? " without" : "")
                                  << " '" << (tag.empty() ? ", paged" : tag) << "', ran "
                                  << kernel << "\n  case: " << c.describe() << "\n  run: " << run;
}

// TESSERA_PREFILL_KERNEL=sm80 for the guard's lifetime: plans choose the portable kernels.
class ForcePortablePrefill {
 public:
  ForcePortablePrefill() : env_("TESSERA_PREFILL_KERNEL", "sm80") {}

 private:
  test::ScopedEnv env_;
};

// What the CUDA kernels serve: fp16/bf16 q with K/V of the same dtype, prefill (ragged queries),
// strides that are multiples of 8 elements (16-byte rows for cp.async).
test::RandomCaseOptions gpu_case_options() {
  test::RandomCaseOptions options;
  options.q_dtypes = {DType::kFloat16, DType::kBFloat16};
  options.allow_fp8_kv = false;
  return options;
}

AttentionCase make_gpu_case(AttentionCase c) {
  c.uniform_q = false;
  for (int32_t* pad : {&c.q_head_pad, &c.q_token_pad, &c.o_head_pad, &c.o_token_pad, &c.kv_head_pad,
                       &c.kv_token_pad}) {
    *pad = *pad / 8 * 8;
  }
  return c;
}

// Reference once, then the three plans of the file comment.
void check_case(const AttentionCase& c, std::mt19937_64& rng) {
  AttentionBuffers buffers = test::make_buffers(c, rng);
  const Outputs expected = run_reference(buffers);
  DeviceCase device(buffers);

  const bool sm90 = sm90_serves(c);
  const char* family = sm90 ? "tessera::sm90::" : "tessera::sm80::";
  const Plan plan = public_plan(buffers);
  expect_close(buffers, run_public(buffers, device, plan), expected, "public plan");
  expect_family(c, plan, family, "public plan");
  if (sm90) {
    const ForcePortablePrefill portable;  // chosen at plan time: plan again
    const Plan portable_plan = public_plan(buffers);
    expect_close(buffers, run_public(buffers, device, portable_plan), expected,
                 "public plan on sm80");
    expect_family(c, portable_plan, "tessera::sm80::", "public plan on sm80");
  }

  const int32_t workers = std::uniform_int_distribution<int32_t>(1, 300)(rng);
  const Plan split = forced_split_plan(c, workers);
  expect_close(buffers, run_public(buffers, device, split), expected,
               "forced split-KV plan, workers=" + std::to_string(workers) +
                   " merges=" + std::to_string(split.merges.size()));
  expect_family(c, split, family, "forced split-KV plan");

  test::TestPlanOptions hand_made;
  const int32_t tile_rows[] = {1, 16, 64, 100, 128, 256, 300};
  const int32_t kv_chunks[] = {0, 1, 17, 64, 100};
  hand_made.q_tile_rows = tile_rows[rng() % std::size(tile_rows)];
  hand_made.kv_chunk = kv_chunks[rng() % std::size(kv_chunks)];
  hand_made.num_workers = std::uniform_int_distribution<int32_t>(1, 64)(rng);
  const std::string hand_made_run = "hand-made plan q_tile_rows=" +
                                    std::to_string(hand_made.q_tile_rows) +
                                    " kv_chunk=" + std::to_string(hand_made.kv_chunk) +
                                    " workers=" + std::to_string(hand_made.num_workers);
  expect_close(buffers, run_hand_made(buffers, device, hand_made), expected, hand_made_run);
  if (c.total_q() > 0) {
    const std::string kernel = detail::cuda_last_prefill_kernel();
    EXPECT_EQ(kernel.rfind(family, 0), 0u) << "ran " << kernel << "\n  " << hand_made_run;
  }
}

void run_random_suite(int cases, uint64_t seed, const test::RandomCaseOptions& options) {
  std::mt19937_64 rng(seed);
  for (int i = 0; i < cases; ++i) {
    const AttentionCase c = make_gpu_case(test::random_case(rng, options));
    SCOPED_TRACE("random case " + std::to_string(i) + " (seed " + std::to_string(seed) + ")");
    check_case(c, rng);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// A case with every length set by hand.
AttentionCase manual_case(std::vector<int32_t> q_lens, std::vector<int32_t> kv_lens,
                          int32_t num_qo_heads, int32_t num_kv_heads, int32_t head_dim,
                          DType dtype) {
  AttentionCase c;
  c.q_lens = std::move(q_lens);
  c.kv_lens = std::move(kv_lens);
  c.num_qo_heads = num_qo_heads;
  c.num_kv_heads = num_kv_heads;
  c.head_dim = head_dim;
  c.q_dtype = c.kv_dtype = dtype;
  return c;
}

// ---- the simplest shapes first (a failure here points at the kernel core) ----

TEST(CudaPrefill, AFewPlainShapes) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 9);
  for (int32_t head_dim : {128, 64, 256}) {
    for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
      // One full 128-row tile against exactly one / two key tiles, then lengths that are not
      // multiples of any tile.
      SCOPED_TRACE("head_dim " + std::to_string(head_dim));
      check_case(manual_case({128}, {128}, 1, 1, head_dim, dtype), rng);
      check_case(manual_case({128}, {256}, 2, 2, head_dim, dtype), rng);
      check_case(manual_case({200, 37}, {333, 1000}, 8, 2, head_dim, dtype), rng);
    }
  }
}

// Programmatic dependent launch (RunOptions::enable_pdl): the same bits as the ordinary launch,
// on the sm90 kernels (ragged, paged) and the sm80 ones, and with a split plan (merge kernel
// after a PDL-launched attention kernel).
TEST(CudaPrefill, PdlLaunchMatchesTheOrdinaryOne) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 23);
  RunOptions pdl;
  pdl.enable_pdl = true;
  for (const bool paged : {false, true}) {
    AttentionCase c = manual_case({200, 37, 640}, {333, 1000, 640}, 16, 4, 128, DType::kBFloat16);
    c.causal = true;
    c.paged = paged;
    c.page_size = 16;
    c = make_gpu_case(c);
    SCOPED_TRACE(paged ? "paged" : "ragged");
    AttentionBuffers buffers = test::make_buffers(c, rng);
    const Outputs expected = run_reference(buffers);
    DeviceCase device(buffers);
    for (const bool portable : {false, true}) {
      std::optional<ForcePortablePrefill> force;
      if (portable) force.emplace();
      for (const bool split : {false, true}) {
        const Plan plan = split ? forced_split_plan(c, 97) : public_plan(buffers);
        const Outputs ordinary = run_public(buffers, device, plan);
        const Outputs programmatic = run_public(buffers, device, plan, pdl);
        const std::string run = std::string(portable ? "sm80" : "default") +
                                (split ? " split plan" : " plan") + " with PDL";
        expect_close(buffers, programmatic, expected, run);
        EXPECT_TRUE(programmatic.o == ordinary.o && programmatic.lse == ordinary.lse)
            << run << " changed bits";
      }
    }
  }
}

// ---- random suites ----

TEST(CudaPrefill, RandomRaggedAndPagedCasesMatchReference) {
  TESSERA_SKIP_WITHOUT_GPU();
  // >= 200 configurations; random_case makes about half of them paged (NHD and HND, page sizes
  // 1 .. 128) and covers GQA ratios, head_dims (any multiple of 8), masks, soft-cap and strides.
  run_random_suite(reduced_run() ? 12 : 240, base_seed(), gpu_case_options());
}

TEST(CudaPrefill, RandomLongCasesMatchReference) {
  TESSERA_SKIP_WITHOUT_GPU();
  // Fewer, longer requests: many key tiles per CTA tile, so the cp.async pipeline wraps around
  // its buffers many times and split-KV produces many pieces.
  test::RandomCaseOptions options = gpu_case_options();
  options.max_batch = 2;
  options.max_q_len = 300;
  options.max_kv_len = 2000;
  options.max_reference_macs = 60'000'000;
  run_random_suite(reduced_run() ? 3 : 24, base_seed() + 1, options);
}

// ---- hand-picked edge cases ----

TEST(CudaPrefill, RowsWithoutKeysGiveZeroAndMinusInf) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 2);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    // Causal with q_len > kv_len (the first rows see nothing), an empty request, a request
    // without queries, and a window that leaves some middle rows keyless.
    AttentionCase c = manual_case({40, 5, 0, 70}, {10, 0, 30, 200}, 8, 2, 128, dtype);
    c.causal = true;
    check_case(c, rng);
    c.causal = false;
    c.window_left = 0;
    c.window_right = 0;
    check_case(c, rng);
  }
}

TEST(CudaPrefill, GroupLargerThanTheCtaTile) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 3);
  // 96 query heads per kv head at d256 (64-row CTA tiles) and 160 at d128 (128-row tiles): a
  // work item holds more packed rows than one CTA tile and is walked in several.
  check_case(manual_case({3, 17}, {90, 33}, 96, 1, 256, DType::kBFloat16), rng);
  AttentionCase c = manual_case({9}, {150}, 160, 1, 128, DType::kFloat16);
  c.causal = true;
  check_case(c, rng);
}

TEST(CudaPrefill, PaddedHeadDims) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 4);
  for (int32_t head_dim : {8, 40, 64, 72, 136, 200, 248, 256}) {
    AttentionCase c = manual_case({33, 70}, {65, 129}, 4, 2, head_dim, DType::kFloat16);
    c.window_left = 20;
    c.window_right = 3;
    c.q_head_pad = 8;
    c.kv_token_pad = 16;
    SCOPED_TRACE("head_dim " + std::to_string(head_dim));
    check_case(c, rng);
  }
}

TEST(CudaPrefill, PagedLayoutsAndPageSizes) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 5);
  for (KVLayout layout : {KVLayout::kNHD, KVLayout::kHND}) {
    // 1, 7: gathered by the sm90 producer; 8 .. 128: one TMA box per page (8 .. 64 at head_dim
    // 128: the page-by-page V kernel, one box per page for both column blocks, its tails
    // gathered into the same layout); 256: pages larger than a key tile (TMA boxes inside a
    // page). Soft-cap on every other size, so both kernel variants of each shape run.
    int index = 0;
    for (int32_t page_size : {1, 7, 8, 16, 32, 64, 128, 256}) {
      AttentionCase c = manual_case({64, 1, 129}, {300, 77, 129}, 8, 4, 128, DType::kBFloat16);
      c.paged = true;
      c.layout = layout;
      c.page_size = page_size;
      c.spare_pages = 3;
      c.causal = index % 3 != 2;
      c.soft_cap = index++ % 2 == 0 ? 30.0f : 0.0f;
      SCOPED_TRACE("page_size " + std::to_string(page_size));
      check_case(c, rng);
    }
  }
}

// d128 over pages of one size: every dtype, soft-cap and mask variant (causal, none, causal with
// soft-cap), each GQA group of `groups` (of 8 query heads), NHD and HND alternately, the given
// requests.
void check_page_variants(int32_t page_size, const std::vector<int32_t>& q_lens,
                         const std::vector<int32_t>& kv_lens, std::initializer_list<int> groups,
                         int32_t spare_pages, uint64_t seed) {
  std::mt19937_64 rng(seed);
  int index = 0;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    for (int group : groups) {
      for (int variant = 0; variant < 3; ++variant) {
        AttentionCase c = manual_case(q_lens, kv_lens, 8, 8 / group, 128, dtype);
        c.paged = true;
        c.layout = index % 2 == 0 ? KVLayout::kNHD : KVLayout::kHND;
        c.page_size = page_size;
        c.spare_pages = spare_pages;
        c.causal = variant != 1;
        c.soft_cap = variant == 2 ? 25.0f : 0.0f;
        SCOPED_TRACE("case " + std::to_string(index++));
        check_case(c, rng);
      }
    }
  }
}

// The page-by-page V kernel at its largest page (two pages per key tile), GQA groups 1 and 4:
// requests ending inside a page and inside a key tile (their last tile gathered into the page
// layout), an empty request, and one of exactly one page.
TEST(CudaPrefill, PagesOf64KeysEveryVariant) {
  TESSERA_SKIP_WITHOUT_GPU();
  check_page_variants(64, {70, 0, 64, 33}, {200, 0, 64, 390}, {1, 4}, 2, base_seed() + 11);
}

// 16-key pages, GQA groups 1, 4 and 8: requests ending inside a page and inside a key tile (their
// last tile gathered into the page layout), an empty request, one of a single page and one of a
// single key tile. Served by the page-by-page V kernel.
TEST(CudaPrefill, PagesOf16KeysEveryVariant) {
  TESSERA_SKIP_WITHOUT_GPU();
  check_page_variants(16, {70, 0, 16, 33, 128}, {300, 0, 16, 390, 128}, {1, 4, 8}, 3,
                      base_seed() + 13);
}

// ---- errors ----

TEST(CudaPrefill, RejectsFp8KvCacheNamingKDtype) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 6);
  AttentionCase c = manual_case({4}, {20}, 2, 1, 64, DType::kFloat16);
  c.kv_dtype = DType::kFloat8E4M3;
  AttentionBuffers buffers = test::make_buffers(c, rng);
  DeviceCase device(buffers);
  try {
    run_public(buffers, device, public_plan(buffers));
    FAIL() << "fp8 K/V ran on the CUDA prefill kernels";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), Error::Kind::kUnsupported);
    EXPECT_NE(std::string(error.what()).find("'k': dtype"), std::string::npos) << error.what();
  }
}

TEST(CudaPrefill, RejectsStridesThatAreNotMultiplesOf8) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 7);
  AttentionCase c = manual_case({4}, {20}, 2, 1, 64, DType::kFloat16);
  c.q_head_pad = 4;
  AttentionBuffers buffers = test::make_buffers(c, rng);
  DeviceCase device(buffers);
  try {
    run_public(buffers, device, public_plan(buffers));
    FAIL() << "a q head stride of 68 elements was accepted";
  } catch (const Error& error) {
    EXPECT_EQ(error.kind(), Error::Kind::kUnsupported);
    EXPECT_NE(std::string(error.what()).find("stride"), std::string::npos) << error.what();
  }
}

// ---- checked mode: device-resident index arrays validated before any kernel runs ----

// Restores index checking to what it was.
class IndexCheckingScope {
 public:
  explicit IndexCheckingScope(bool on) : saved_(index_checking()) { set_index_checking(on); }
  ~IndexCheckingScope() { set_index_checking(saved_); }
  IndexCheckingScope(const IndexCheckingScope&) = delete;
  IndexCheckingScope& operator=(const IndexCheckingScope&) = delete;

 private:
  bool saved_;
};

TEST(CudaPrefill, CheckedModeRejectsBadDeviceIndicesAndWritesNothing) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 10);
  AttentionCase c = manual_case({5, 9}, {40, 70}, 4, 2, 128, DType::kBFloat16);
  c.paged = true;
  c.page_size = 16;
  AttentionBuffers buffers = test::make_buffers(c, rng);
  const Plan plan = public_plan(buffers);
  const IndexCheckingScope checking(true);
  const auto expect_rejected = [&](AttentionBuffers& bad, const std::string& argument,
                                   const std::string& detail) {
    DeviceCase device(bad);
    try {
      run_public(bad, device, plan);
      ADD_FAILURE() << "a corrupt " << argument << " was accepted in checked mode";
    } catch (const Error& error) {
      const std::string message = error.what();
      EXPECT_NE(message.find(argument), std::string::npos) << message;
      EXPECT_NE(message.find(detail), std::string::npos) << message;
    }
    // Nothing was written: the outputs keep their poison.
    const Outputs out = device.download();
    EXPECT_EQ(out.o, bad.o);
    EXPECT_EQ(out.lse, bad.lse);
  };
  {
    AttentionBuffers bad = buffers;
    bad.page_indices[1] = static_cast<int32_t>(bad.num_pages) + 7;
    expect_rejected(bad, "page_indices", "entry 1");
  }
  {
    AttentionBuffers bad = buffers;
    std::swap(bad.qo_indptr[1], bad.qo_indptr[2]);  // not monotone
    expect_rejected(bad, "qo_indptr", "qo_indptr");
  }
  {
    AttentionBuffers bad = buffers;
    bad.last_page_len[0] = c.page_size + 1;
    expect_rejected(bad, "last_page_len", "last_page_len");
  }
  // The intact arrays pass the checks and give the reference result.
  const Outputs expected = run_reference(buffers);
  DeviceCase device(buffers);
  expect_close(buffers, run_public(buffers, device, plan), expected, "checked mode, valid input");
}

// ---- compute-sanitizer set: few, small, every code path ----

TEST(CudaPrefillSanitizer, SmallCasesEveryPath) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(base_seed() + 8);
  test::RandomCaseOptions options = gpu_case_options();
  options.max_q_len = 24;
  options.max_kv_len = 150;
  options.max_reference_macs = 1'000'000;
  for (int i = 0; i < 6; ++i) {
    AttentionCase c = make_gpu_case(test::random_case(rng, options));
    c.head_dim = (i % 3 == 0) ? 64 : (i % 3 == 1) ? 128 : 256;  // one kernel bucket each
    c.paged = i % 2 == 1;
    c.causal = i >= 2;
    c.soft_cap = i == 4 ? 20.0f : 0.0f;
    SCOPED_TRACE("sanitizer case " + std::to_string(i));
    check_case(c, rng);
  }
  // d128 over 16-key pages (the page-by-page V kernel): a TMA key tile and a gathered tail.
  AttentionCase c = manual_case({20, 3}, {150, 40}, 8, 2, 128, DType::kBFloat16);
  c.paged = true;
  c.page_size = 16;
  c.causal = true;
  SCOPED_TRACE("sanitizer case: page 16, head_dim 128");
  check_case(c, rng);
  // d128 over 64-key pages (two per key tile): a TMA key tile and a gathered tail.
  c.page_size = 64;
  c.causal = false;
  SCOPED_TRACE("sanitizer case: page 64, head_dim 128");
  check_case(c, rng);
}

#else  // !TESSERA_HAVE_CUDA

TEST(CudaPrefill, BuiltWithoutCuda) {
  GTEST_SKIP() << "no CUDA device: GPU tests skipped (this build has no CUDA backend)";
}

#endif

}  // namespace
}  // namespace tessera
