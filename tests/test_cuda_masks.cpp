// Custom and tree masks on a CUDA plan (issue 34 items 4 and 5): the masks run on the CPU
// backend only for now, so a CUDA plan given one throws Error(kUnsupported) naming the field
// ('run_options.custom_mask' / 'run_options.tree_mask') before anything is launched: o and lse
// keep the bytes they held, for ragged prefill, paged prefill and decode, through plan + run and
// the one-shot calls, with the masks in device memory or host memory, and the C ABI answers
// TESSERA_ERROR_UNSUPPORTED naming the field. The same plans without masks then run (the
// rejection left the library usable).
//
// Without a CUDA device every test skips (exit 77 under ctest).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/api_runner.hpp"
#include "common/attention_testing.hpp"
#include "common/gpu_test_support.hpp"
#include "common/masks_testing.hpp"
#include "common/validation_fixture.hpp"
#include "tessera/tessera.h"
#include "tessera/tessera.hpp"

namespace tessera {
namespace {

#if defined(TESSERA_HAVE_CUDA)

using test::AttentionBuffers;
using test::AttentionCase;
using test::DeviceBuffer;
using test::gpu_index_view;
using test::kGpu;

constexpr uint8_t kUntouched = 0x7b;  // the outputs' bytes before every call

enum class Op { kRagged, kPaged, kDecode };

AttentionCase small_case(Op op) {
  AttentionCase c;
  c.q_lens = op == Op::kDecode ? std::vector<int32_t>{2, 2} : std::vector<int32_t>{3, 2};
  c.kv_lens = {5, 4};
  c.uniform_q = op == Op::kDecode;
  c.paged = op != Op::kRagged;
  c.page_size = 2;
  c.num_qo_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 64;
  c.q_dtype = c.kv_dtype = DType::kFloat16;
  c.causal = true;
  return c;
}

// One case's tensors on the GPU (contiguous, as make_buffers lays them out without padding).
struct GpuCase {
  AttentionBuffers buffers;
  test::CaseMasks masks;
  DeviceBuffer q, k, v, o, lse, qo_indptr, kv_indptr, page_indptr, page_indices, last_page_len;
  DeviceBuffer custom, mask_indptr, tree;
  Plan plan;
  DeviceBuffer workspace;

  GpuCase(Op op, std::mt19937_64& rng)
      : buffers(test::make_buffers(small_case(op), rng)),
        masks(op == Op::kDecode
                  ? test::tree_masks(buffers.test_case, test::TreeShape::kTree, rng)
                  : test::custom_masks(buffers.test_case, test::MaskPattern::kRandom, rng)),
        q(buffers.q),
        k(buffers.k),
        v(buffers.v),
        o(buffers.o.size()),
        lse(buffers.lse.size()),
        qo_indptr(buffers.qo_indptr),
        kv_indptr(std::max<size_t>(buffers.kv_indptr.size(), 1) * 4),
        page_indptr(std::max<size_t>(buffers.page_indptr.size(), 1) * 4),
        page_indices(std::max<size_t>(buffers.page_indices.size(), 1) * 4),
        last_page_len(std::max<size_t>(buffers.last_page_len.size(), 1) * 4),
        custom(std::max<size_t>(masks.custom.size(), 1)),
        mask_indptr(std::max<size_t>(masks.indptr.size(), 1) * 4),
        tree(std::max<size_t>(masks.tree_bytes.size(), 1)),
        plan(test::plan_for(buffers, kGpu)),
        workspace(std::max<size_t>(plan.workspace_bytes, 1)) {
    if (!buffers.kv_indptr.empty()) kv_indptr.upload(buffers.kv_indptr);
    if (!buffers.page_indptr.empty()) {
      page_indptr.upload(buffers.page_indptr);
      page_indices.upload(buffers.page_indices);
      last_page_len.upload(buffers.last_page_len);
    }
    if (!masks.custom.empty()) custom.upload(masks.custom);
    if (!masks.indptr.empty()) mask_indptr.upload(masks.indptr);
    if (masks.tree) tree.upload(masks.tree_bytes);
  }
  const AttentionCase& c() const { return buffers.test_case; }
  void poison() {
    detail::cuda_memset(o.data(), kUntouched, o.bytes(), nullptr);
    detail::cuda_memset(lse.data(), kUntouched, lse.bytes(), nullptr);
  }
  bool untouched() const {
    for (uint8_t byte : o.download<uint8_t>()) {
      if (byte != kUntouched) return false;
    }
    for (uint8_t byte : lse.download<uint8_t>()) {
      if (byte != kUntouched) return false;
    }
    return true;
  }
  // The masks as run options: device copies, or the host bytes.
  RunOptions mask_options(bool on_device) const {
    RunOptions options = masks.run_options();
    if (!on_device) return options;
    for (auto [view, buffer] : {std::pair{&options.custom_mask, &custom},
                                {&options.mask_indptr, &mask_indptr},
                                {&options.tree_mask, &tree}}) {
      if (!has_value(*view)) continue;
      view->data = buffer->data();
      view->device = kGpu;
    }
    return options;
  }
  TensorView rows(const DeviceBuffer& buffer, int64_t heads) const {
    return make_view(buffer.data(), c().q_dtype, {c().total_q(), heads, c().head_dim}, kGpu);
  }
  PagedKVCache cache() const {
    PagedKVCache kv;
    for (auto [target, buffer] : {std::pair{&kv.k_cache, &k}, {&kv.v_cache, &v}}) {
      *target = make_view(buffer->data(), c().kv_dtype,
                          {buffers.num_pages, c().page_size, c().num_kv_heads, c().head_dim}, kGpu);
    }
    kv.page_indptr = gpu_index_view(page_indptr, static_cast<int64_t>(buffers.page_indptr.size()));
    kv.page_indices =
        gpu_index_view(page_indices, static_cast<int64_t>(buffers.page_indices.size()));
    kv.last_page_len =
        gpu_index_view(last_page_len, static_cast<int64_t>(buffers.last_page_len.size()));
    return kv;
  }
  // run_* (one_shot: the one-shot call) with `options`.
  void run(Op op, bool one_shot, const RunOptions& options) {
    const TensorView q_view = rows(q, c().num_qo_heads), o_view = rows(o, c().num_qo_heads);
    const TensorView lse_view =
        make_view(lse.data(), DType::kFloat32, {c().total_q(), c().num_qo_heads}, kGpu);
    const TensorView qo = gpu_index_view(qo_indptr, static_cast<int64_t>(buffers.qo_indptr.size()));
    const Workspace ws{workspace.data(), workspace.bytes()};
    const AttentionOptions attention = test::options_of(c());
    if (op == Op::kRagged) {
      const TensorView k_view =
          make_view(k.data(), c().kv_dtype, {c().total_kv(), c().num_kv_heads, c().head_dim}, kGpu);
      const TensorView v_view =
          make_view(v.data(), c().kv_dtype, {c().total_kv(), c().num_kv_heads, c().head_dim}, kGpu);
      const TensorView kvp =
          gpu_index_view(kv_indptr, static_cast<int64_t>(buffers.kv_indptr.size()));
      if (one_shot) {
        ragged_prefill(q_view, k_view, v_view, qo, kvp, o_view, lse_view, attention, nullptr,
                       options);
      } else {
        run_ragged_prefill(plan, q_view, k_view, v_view, qo, kvp, o_view, lse_view, ws, nullptr,
                           options);
      }
    } else if (op == Op::kPaged) {
      if (one_shot) {
        paged_prefill(q_view, cache(), qo, o_view, lse_view, attention, nullptr, options);
      } else {
        run_paged_prefill(plan, q_view, cache(), qo, o_view, lse_view, ws, nullptr, options);
      }
    } else if (one_shot) {
      decode(q_view, cache(), o_view, lse_view, attention, nullptr, options);
    } else {
      run_decode(plan, q_view, cache(), o_view, lse_view, ws, nullptr, options);
    }
    detail::cuda_synchronize(nullptr);
  }
};

TEST(CudaMasks, CudaPlansRejectMasksBeforeAnyLaunch) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test::seed_from_env(36001));
  for (Op op : {Op::kRagged, Op::kPaged, Op::kDecode}) {
    GpuCase gpu(op, rng);
    const std::string field =
        op == Op::kDecode ? "run_options.tree_mask" : "run_options.custom_mask";
    for (bool one_shot : {false, true}) {
      for (bool on_device : {true, false}) {
        SCOPED_TRACE(field + (one_shot ? ", one-shot" : ", plan + run") +
                     (on_device ? ", device masks" : ", host masks"));
        gpu.poison();
        EXPECT_TRUE(test::fails_with([&] { gpu.run(op, one_shot, gpu.mask_options(on_device)); },
                                     Error::Kind::kUnsupported, "'" + field + "'"));
        EXPECT_TRUE(gpu.untouched()) << "a rejected call wrote o or lse";
      }
    }
    gpu.poison();
    gpu.run(op, false, {});  // the library stays usable: the plan runs without masks
    EXPECT_FALSE(gpu.untouched());
  }
}

TEST(CudaMasks, CAbiAnswersUnsupported) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test::seed_from_env(36002));
  GpuCase gpu(Op::kRagged, rng);
  const AttentionCase& c = gpu.c();
  int64_t q_shape[3] = {c.total_q(), c.num_qo_heads, c.head_dim};
  int64_t kv_shape[3] = {c.total_kv(), c.num_kv_heads, c.head_dim};
  int64_t lse_shape[2] = {c.total_q(), c.num_qo_heads};
  int64_t indptr_shape[1] = {static_cast<int64_t>(gpu.buffers.qo_indptr.size())};
  int64_t mask_shape[1] = {static_cast<int64_t>(gpu.masks.custom.size())};
  const DLDevice device{kDLCUDA, 0};
  auto tensor = [&](const DeviceBuffer& buffer, DLDataType dtype, int ndim, int64_t* shape) {
    return DLTensor{buffer.data(), device, ndim, dtype, shape, nullptr, 0};
  };
  const DLDataType f16{kDLFloat, 16, 1}, f32{kDLFloat, 32, 1}, i32{kDLInt, 32, 1},
      u8{kDLUInt, 8, 1};
  DLTensor q = tensor(gpu.q, f16, 3, q_shape), k = tensor(gpu.k, f16, 3, kv_shape);
  DLTensor v = tensor(gpu.v, f16, 3, kv_shape), o = tensor(gpu.o, f16, 3, q_shape);
  DLTensor lse = tensor(gpu.lse, f32, 2, lse_shape);
  DLTensor qo = tensor(gpu.qo_indptr, i32, 1, indptr_shape);
  DLTensor kvp = tensor(gpu.kv_indptr, i32, 1, indptr_shape);
  DLTensor custom = tensor(gpu.custom, u8, 1, mask_shape);
  DLTensor mask_indptr = tensor(gpu.mask_indptr, i32, 1, indptr_shape);
  tessera_run_options run;
  tessera_run_options_default(&run);
  run.custom_mask = &custom;
  run.mask_indptr = &mask_indptr;
  tessera_attention_options options;
  tessera_attention_options_default(&options);
  options.causal = 1;
  gpu.poison();
  EXPECT_EQ(tessera_ragged_prefill_v2(&q, &k, &v, &qo, &kvp, &o, &lse, &options, nullptr, &run),
            TESSERA_ERROR_UNSUPPORTED)
      << tessera_last_error();
  EXPECT_NE(std::string(tessera_last_error()).find("'run_options.custom_mask'"), std::string::npos)
      << tessera_last_error();
  EXPECT_TRUE(gpu.untouched());
}

#else  // !TESSERA_HAVE_CUDA

TEST(CudaMasks, BuiltWithoutCuda) {
  GTEST_SKIP() << "no CUDA device: GPU tests skipped (this build has no CUDA backend)";
}

#endif

}  // namespace
}  // namespace tessera
