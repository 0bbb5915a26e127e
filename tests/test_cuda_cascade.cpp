// Multi-level cascade attention on the CUDA backend (include/tessera/cascade.hpp): the random
// cases of tests/common/cascade_testing.hpp (1-3 levels, GQA, page sizes 1..128, NHD / HND,
// causal, soft-cap, sinks, rows without keys, unused cache slots NaN; fp16 and bf16) copied to
// the device and compared with the per-row double reference; outputs and workspace poisoned
// (0xff: NaN) before every run. Then a CUDA graph captured around an uploaded run_cascade and
// replayed, and a bad argument (outputs untouched).
//
// Without a CUDA device every test skips (exit 77 under ctest). TESSERA_TEST_REDUCED=1 shrinks
// the random suite; TESSERA_TEST_SEED varies it.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/cascade_testing.hpp"
#include "common/gpu_test_support.hpp"
#include "tessera/tessera.hpp"

#if defined(TESSERA_HAVE_CUDA)
#include <cuda_runtime.h>

#include <memory>

#include "common/cuda_graph_support.hpp"
#include "cuda/cuda_backend.hpp"
#endif

namespace tessera {
namespace {

#if defined(TESSERA_HAVE_CUDA)

using test::CascadeCase;
using test::CascadeData;
using test::DeviceBuffer;
using test::kGpu;

// The case's host data on the device, with views.
struct DeviceCase {
  explicit DeviceCase(const CascadeData& data)
      : k(data.k_pool.empty() ? std::vector<uint8_t>(16) : data.k_pool),
        v(data.v_pool.empty() ? std::vector<uint8_t>(16) : data.v_pool),
        q(data.q),
        sinks(data.sinks.empty() ? std::vector<float>(1) : data.sinks) {
    const CascadeCase& c = data.test_case;
    for (size_t l = 0; l < data.qo_indptr.size(); ++l) {
      indices.emplace_back(new DeviceBuffer(data.qo_indptr[l]));
      indices.emplace_back(new DeviceBuffer(data.page_indptr[l]));
      indices.emplace_back(new DeviceBuffer(data.page_indices[l]));
      indices.emplace_back(new DeviceBuffer(data.last_page_len[l]));
      auto view = [&](size_t i, size_t count) {
        return test::gpu_index_view(*indices[i], static_cast<int64_t>(count));
      };
      const size_t base = 4 * l;
      levels.push_back({view(base, data.qo_indptr[l].size()), view(base + 1, data.page_indptr[l].size()),
                        view(base + 2, data.page_indices[l].size()),
                        view(base + 3, data.last_page_len[l].size())});
    }
    const std::vector<int64_t> s = data.pool_shape();
    k_view = make_view(k.data(), c.dtype, {s[0], s[1], s[2], s[3]}, kGpu);
    v_view = make_view(v.data(), c.dtype, {s[0], s[1], s[2], s[3]}, kGpu);
    const int64_t total_q = c.total_q();
    q_view = make_view(q.data(), c.dtype, {total_q, c.num_qo_heads, c.head_dim}, kGpu);
    o_bytes = static_cast<size_t>(std::max<int64_t>(total_q * c.num_qo_heads * c.head_dim, 1)) *
              dtype_size(c.dtype);
    o.reset(new DeviceBuffer(o_bytes));
    lse.reset(new DeviceBuffer(static_cast<size_t>(std::max<int64_t>(total_q * c.num_qo_heads, 1)) * 4));
    o_view = make_view(o->data(), c.dtype, {total_q, c.num_qo_heads, c.head_dim}, kGpu);
    lse_view = c.with_lse ? make_view(lse->data(), DType::kFloat32, {total_q, c.num_qo_heads}, kGpu)
                          : TensorView{};
    if (c.with_sinks) {
      run_options.sinks = make_view(sinks.data(), DType::kFloat32, {c.num_qo_heads}, kGpu);
    }
  }
  void poison() const {
    detail::cuda_memset(o->data(), 0xff, o->bytes(), nullptr);
    detail::cuda_memset(lse->data(), 0xff, lse->bytes(), nullptr);
  }
  std::vector<uint8_t> o_host(const CascadeCase& c) const {
    std::vector<uint8_t> host = o->download<uint8_t>();
    host.resize(static_cast<size_t>(c.total_q() * c.num_qo_heads * c.head_dim) * dtype_size(c.dtype));
    return host;
  }
  std::vector<float> lse_host(const CascadeCase& c) const {
    if (!c.with_lse) return {};
    std::vector<float> host = lse->download<float>();
    host.resize(static_cast<size_t>(c.total_q() * c.num_qo_heads));
    return host;
  }

  DeviceBuffer k, v, q, sinks;
  std::vector<std::unique_ptr<DeviceBuffer>> indices;
  std::unique_ptr<DeviceBuffer> o, lse;
  size_t o_bytes = 0;
  std::vector<CascadeLevel> levels;
  TensorView k_view, v_view, q_view, o_view, lse_view;
  RunOptions run_options;
};

CascadePlan plan_on_gpu(const CascadeData& data) {
  const CascadeCase& c = data.test_case;
  AttentionOptions options;
  options.causal = c.causal;
  options.logits_soft_cap = c.soft_cap;
  return plan_cascade(data.lengths(), c.page_size, c.num_qo_heads, c.num_kv_heads, c.head_dim,
                      options, kGpu);
}

TEST(CudaCascade, RandomCasesMatchTheReference) {
  TESSERA_SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(test::seed_from_env(0xcafe5));
  const int trials = test::reduced_run() ? 8 : 48;
  for (int trial = 0; trial < trials; ++trial) {
    test::RandomCascadeOptions options;
    options.dtypes = {DType::kFloat16, DType::kBFloat16};
    options.decode_only = trial % 3 == 0;
    options.max_prefix_len = trial % 4 == 0 ? 3000 : 300;
    const CascadeData data = make_cascade_data(random_cascade_case(rng, options), rng);
    const test::CascadeExpected expected = test::reference_cascade(data);
    const CascadePlan plan = plan_on_gpu(data);
    DeviceCase device(data);
    DeviceBuffer workspace(std::max<size_t>(plan.workspace_bytes, 1));
    detail::cuda_memset(workspace.data(), 0xff, workspace.bytes(), nullptr);
    device.poison();
    run_cascade(plan, device.q_view, device.k_view, device.v_view, data.test_case.layout,
                device.levels, device.o_view, device.lse_view,
                {workspace.data(), workspace.bytes()}, nullptr, device.run_options);
    detail::cuda_synchronize(nullptr);
    const std::string diff =
        test::compare_cascade(data, expected, device.o_host(data.test_case),
                              device.lse_host(data.test_case), 1e-2);
    EXPECT_EQ(diff, "") << data.test_case.describe();
  }
}

// 64 decode requests sharing one prefix (the bench's cascade shape, shortened): uploaded once,
// captured into a graph, replayed twice with fresh poison in between.
TEST(CudaCascade, GraphReplayOfAnUploadedPlan) {
  TESSERA_SKIP_WITHOUT_GPU();
  CascadeCase c;
  c.num_qo_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.dtype = DType::kBFloat16;
  c.q_lens.assign(64, 1);
  c.groups = {{0, 64}, {}};
  c.kv_lens = {{2048}, {}};
  for (int32_t b = 0; b <= 64; ++b) c.groups[1].push_back(b);
  for (int32_t b = 0; b < 64; ++b) c.kv_lens[1].push_back(1 + (b * 37) % 200);
  std::mt19937_64 rng(11);
  const CascadeData data = make_cascade_data(c, rng);
  const test::CascadeExpected expected = test::reference_cascade(data);
  CascadePlan plan = plan_on_gpu(data);
  EXPECT_EQ(plan.levels[1].op, AttentionOp::kDecode);
  DeviceCase device(data);
  DeviceBuffer workspace(plan.workspace_bytes);
  const Workspace ws{workspace.data(), workspace.bytes()};
  test::CudaStream stream;
  const cudaStream_t s = stream.get();
  upload_cascade(plan, ws, s);
  test::CudaGraph graph;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  try {
    run_cascade(plan, device.q_view, device.k_view, device.v_view, c.layout, device.levels,
                device.o_view, device.lse_view, ws, s);
  } catch (const std::exception& e) {
    cudaStreamEndCapture(s, &graph.graph);
    FAIL() << "run_cascade during capture: " << e.what();
  }
  ASSERT_EQ(cudaStreamEndCapture(s, &graph.graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&graph.exec, graph.graph, 0), cudaSuccess);
  for (int replay = 0; replay < 2; ++replay) {
    device.poison();
    detail::cuda_synchronize(nullptr);
    ASSERT_EQ(cudaGraphLaunch(graph.exec, s), cudaSuccess);
    detail::cuda_synchronize(s);
    EXPECT_EQ(test::compare_cascade(data, expected, device.o_host(c), device.lse_host(c), 1e-2), "")
        << "replay " << replay;
  }
}

TEST(CudaCascade, BadLevelCountWritesNothing) {
  TESSERA_SKIP_WITHOUT_GPU();
  CascadeCase c;
  c.q_lens = {2, 1};
  c.groups = {{0, 2}, {0, 1, 2}};
  c.kv_lens = {{40}, {7, 3}};
  std::mt19937_64 rng(5);
  const CascadeData data = make_cascade_data(c, rng);
  const CascadePlan plan = plan_on_gpu(data);
  DeviceCase device(data);
  DeviceBuffer workspace(plan.workspace_bytes);
  detail::cuda_memset(device.o->data(), 0x5a, device.o->bytes(), nullptr);
  const std::vector<CascadeLevel> one(device.levels.begin(), device.levels.begin() + 1);
  EXPECT_THROW(run_cascade(plan, device.q_view, device.k_view, device.v_view, c.layout, one,
                           device.o_view, device.lse_view, {workspace.data(), workspace.bytes()}),
               Error);
  for (uint8_t byte : device.o->download<uint8_t>()) ASSERT_EQ(byte, 0x5a);
}

#else  // !TESSERA_HAVE_CUDA

TEST(CudaCascade, BuiltWithoutCuda) {
  GTEST_SKIP() << "no CUDA device: GPU tests skipped (this build has no CUDA backend)";
}

#endif

}  // namespace
}  // namespace tessera
