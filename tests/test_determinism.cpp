// Bitwise determinism of the attention paths.
//  * CPU fast path: the same plan run 100 times gives identical bytes, whatever the thread count
//    (1, 2, 4) executing it.
//  * Plans made with PlanConfig::deterministic = true (fixed split-KV boundaries at absolute key
//    positions): a request's rows are bit-identical whether it runs alone or inside a larger
//    batch, and whatever the worker/thread count the plan was made for (CPU; CUDA when a device
//    is present, else skipped with a message).
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "common/api_runner.hpp"
#include "common/attention_testing.hpp"
#include "core/dispatch.hpp"
#include "core/planner.hpp"
#include "tessera/tessera.hpp"

namespace tessera::test {
namespace {

const Device kCpu{DeviceType::kCPU, 0};
const Device kCuda{DeviceType::kCUDA, 0};

class ThreadsGuard {
 public:
  ~ThreadsGuard() {
    set_num_threads(0);
    set_cpu_impl(CpuImpl::kFast);
  }
};

AttentionCase mixed_case(DType dtype, bool paged, bool causal) {
  AttentionCase c;
  // Long key ranges (split-KV on the CPU: min chunk 512) mixed with short ones, GQA 4.
  c.q_lens = {7, 1, 33, 0, 12};
  c.kv_lens = {1500, 40, 1200, 9, 700};
  c.num_qo_heads = 8;
  c.num_kv_heads = 2;
  c.head_dim = 64;
  c.q_dtype = c.kv_dtype = dtype;
  c.paged = paged;
  c.page_size = 16;
  c.causal = causal;
  return c;
}

// Plan for `buffers` on `device`, with the backend's knobs but deterministic splits.
Plan deterministic_plan(const AttentionBuffers& buffers, Device device, int workers = 0) {
  const AttentionCase& c = buffers.test_case;
  detail::PlanShape shape;
  shape.op = op_of(c);
  shape.device = device;
  shape.q_lens = c.q_lens;
  shape.kv_lens = c.kv_lens;
  shape.num_qo_heads = c.num_qo_heads;
  shape.num_kv_heads = c.num_kv_heads;
  shape.head_dim = c.head_dim;
  shape.page_size = c.paged ? c.page_size : 0;
  shape.options = options_of(c);
  PlanConfig config =
      detail::plan_config_for(shape.op, device, c.num_qo_heads, c.num_kv_heads, c.head_dim);
  config.deterministic = true;
  if (workers > 0) config.num_workers = workers;
  return detail::make_plan(shape, config);
}

TEST(DeterminismCpu, RepeatedRunsAndThreadCounts) {
  ThreadsGuard guard;
  set_cpu_impl(CpuImpl::kFast);
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
    for (bool paged : {false, true}) {
      AttentionCase c = mixed_case(dtype, paged, /*causal=*/true);
      std::mt19937_64 rng(21);
      AttentionBuffers buffers = make_buffers(c, rng);
      set_num_threads(4);
      const Plan plan = plan_for(buffers, kCpu);  // the public planner (may split the keys)
      const Outputs first = run_through_api(buffers, kCpu, &plan);
      for (int threads : {1, 2, 4}) {
        set_num_threads(threads);
        const int repeats = threads == 4 ? 100 : 10;
        for (int r = 0; r < repeats; ++r) {
          const Outputs again = run_through_api(buffers, kCpu, &plan);
          ASSERT_EQ(again.o, first.o) << "o differs: threads " << threads << " run " << r << "; "
                                      << c.describe();
          ASSERT_EQ(again.lse, first.lse) << "lse differs: threads " << threads << " run " << r;
        }
      }
    }
  }
}

TEST(DeterminismCpu, DeterministicPlansAcrossWorkerCounts) {
  // A deterministic plan made for 1, 2, 4 or 7 workers (and run with that many threads) gives
  // identical bytes: the split boundaries do not depend on the worker count.
  ThreadsGuard guard;
  for (bool paged : {false, true}) {
    AttentionCase c = mixed_case(DType::kBFloat16, paged, /*causal=*/false);
    std::mt19937_64 rng(22);
    AttentionBuffers buffers = make_buffers(c, rng);
    set_num_threads(1);
    const Outputs reference = run_through_api(buffers, kCpu, nullptr);
    (void)reference;
    Outputs first;
    for (int workers : {1, 2, 4, 7}) {
      set_num_threads(std::min(workers, 4));
      const Plan plan = deterministic_plan(buffers, kCpu, workers);
      const Outputs out = run_through_api(buffers, kCpu, &plan);
      if (workers == 1) {
        first = out;
        EXPECT_FALSE(plan.merges.empty()) << "expected split-KV in this case";
        continue;
      }
      ASSERT_EQ(out.o, first.o) << "workers " << workers << "; " << c.describe();
      ASSERT_EQ(out.lse, first.lse) << "workers " << workers;
    }
  }
}

// Copies request `b` of a ragged or paged batch into a batch of its own (contiguous layouts).
AttentionBuffers alone(const AttentionBuffers& batch, int b, std::mt19937_64& rng) {
  const AttentionCase& c = batch.test_case;
  AttentionCase single = c;
  single.q_lens = {c.q_lens[b]};
  single.kv_lens = {c.kv_lens[b]};
  AttentionBuffers one = make_buffers(single, rng);
  const size_t qb = c.q_dtype == DType::kFloat32 ? 4 : 2;
  const size_t kb = c.kv_dtype == DType::kFloat32 ? 4 : (c.kv_dtype == DType::kFloat16 ||
                                                         c.kv_dtype == DType::kBFloat16 ? 2 : 1);
  const size_t q_row = batch.q_stride_token * qb;
  std::memcpy(one.q.data(), batch.q.data() + batch.qo_indptr[b] * q_row,
              static_cast<size_t>(c.q_lens[b]) * q_row);
  if (!c.paged) {
    const size_t kv_row = batch.kv_stride_token * kb;
    std::memcpy(one.k.data(), batch.k.data() + batch.kv_indptr[b] * kv_row,
                static_cast<size_t>(c.kv_lens[b]) * kv_row);
    std::memcpy(one.v.data(), batch.v.data() + batch.kv_indptr[b] * kv_row,
                static_cast<size_t>(c.kv_lens[b]) * kv_row);
  } else {
    const size_t page = batch.kv_stride_page * kb;
    for (int32_t p = 0; p < batch.page_indptr[b + 1] - batch.page_indptr[b]; ++p) {
      const int32_t src = batch.page_indices[batch.page_indptr[b] + p];
      const int32_t dst = one.page_indices[p];
      std::memcpy(one.k.data() + dst * page, batch.k.data() + src * page, page);
      std::memcpy(one.v.data() + dst * page, batch.v.data() + src * page, page);
    }
  }
  return one;
}

void check_alone_vs_batch(Device device, DType dtype, bool paged, bool causal) {
  AttentionCase c = mixed_case(dtype, paged, causal);
  std::mt19937_64 rng(23);
  AttentionBuffers batch = make_buffers(c, rng);
  const Plan batch_plan = deterministic_plan(batch, device);
  const Outputs batch_out = run_through_api(batch, device, &batch_plan);
  const size_t ob = dtype == DType::kFloat32 ? 4 : 2;
  for (int b : {0, 2, 4}) {
    AttentionBuffers one = alone(batch, b, rng);
    const Plan one_plan = deterministic_plan(one, device);
    const Outputs one_out = run_through_api(one, device, &one_plan);
    const size_t o_row = batch.o_stride_token * ob, lse_row = batch.lse_stride_token * 4;
    const size_t rows = static_cast<size_t>(c.q_lens[b]);
    ASSERT_EQ(0, std::memcmp(one_out.o.data(), batch_out.o.data() + batch.qo_indptr[b] * o_row,
                             rows * o_row))
        << "request " << b << " alone differs from the batch on " << device_name(device) << "; "
        << c.describe();
    ASSERT_EQ(0, std::memcmp(one_out.lse.data(),
                             batch_out.lse.data() + batch.qo_indptr[b] * lse_row, rows * lse_row))
        << "lse of request " << b << " alone differs from the batch";
  }
}

TEST(DeterminismCpu, RequestAloneVsInBatch) {
  ThreadsGuard guard;
  for (int threads : {1, 4}) {
    set_num_threads(threads);
    for (DType dtype : {DType::kFloat16, DType::kFloat32}) {
      for (bool paged : {false, true}) {
        for (bool causal : {false, true}) {
          SCOPED_TRACE(testing::Message() << "threads " << threads);
          check_alone_vs_batch(kCpu, dtype, paged, causal);
        }
      }
    }
  }
}

TEST(DeterminismCuda, RequestAloneVsInBatch) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device: GPU determinism skipped";
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (bool paged : {false, true}) {
      for (bool causal : {false, true}) check_alone_vs_batch(kCuda, dtype, paged, causal);
    }
  }
}

TEST(DeterminismCuda, RepeatedRuns) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device: GPU determinism skipped";
  for (bool paged : {false, true}) {
    AttentionCase c = mixed_case(DType::kBFloat16, paged, true);
    std::mt19937_64 rng(24);
    AttentionBuffers buffers = make_buffers(c, rng);
    const Plan plan = deterministic_plan(buffers, kCuda);
    const Outputs first = run_through_api(buffers, kCuda, &plan);
    for (int r = 0; r < 20; ++r) {
      const Outputs again = run_through_api(buffers, kCuda, &plan);
      ASSERT_EQ(again.o, first.o) << "run " << r;
      ASSERT_EQ(again.lse, first.lse) << "run " << r;
    }
  }
}

}  // namespace
}  // namespace tessera::test
