// Bitwise determinism of the attention paths.
//  * CPU fast path: the same plan run 100 times gives identical bytes, whatever the thread count
//    (1, 2, 4) executing it.
//  * Plans made with PlanConfig::deterministic = true (fixed split-KV boundaries at absolute key
//    positions): a request's rows are bit-identical whatever batch it runs in -- alone, in the
//    original batch, in the batch reversed followed by the batch again (every request twice) --
//    and whatever the worker/thread count the plan was made for (CPU). Ragged and paged prefill
//    and decode (paged, 1 and 4 queries per request), on the CPU and, when a device is present,
//    on CUDA (else skipped with a message).
//  * CUDA: a deterministic plan run 100 times gives identical bytes (ragged and paged prefill,
//    decode). TESSERA_TEST_REDUCED=1 (compute-sanitizer runs) makes that 10.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
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

// TESSERA_TEST_REDUCED=1: fewer repetitions (compute-sanitizer runs).
bool reduced_run() {
  const char* env = std::getenv("TESSERA_TEST_REDUCED");
  return env != nullptr && std::string(env) == "1";
}

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

// Decode: q_per_request queries per request over a paged cache (the public decode op), key
// ranges long enough to split (both backends' minimum split chunk is at most 512 keys) mixed
// with short ones; GQA 4 at head_dim 128, the decode kernels' main shape.
AttentionCase decode_case(DType dtype, int32_t q_per_request) {
  AttentionCase c;
  c.kv_lens = {1500, 40, 1200, 9, 700, 2100};
  c.q_lens.assign(c.kv_lens.size(), q_per_request);
  c.uniform_q = true;
  c.paged = true;
  c.page_size = 16;
  c.num_qo_heads = 16;
  c.num_kv_heads = 4;
  c.head_dim = 128;
  c.q_dtype = c.kv_dtype = dtype;
  c.causal = q_per_request > 1;
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

size_t element_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    default: return 1;
  }
}

// A batch of the requests `order` of `batch` (indices may repeat), each with its q and K/V rows
// copied from `batch` (contiguous layouts; new random page placement when paged).
AttentionBuffers rebatch(const AttentionBuffers& batch, const std::vector<int>& order,
                         std::mt19937_64& rng) {
  const AttentionCase& c = batch.test_case;
  AttentionCase sub = c;
  sub.q_lens.clear();
  sub.kv_lens.clear();
  for (int b : order) {
    sub.q_lens.push_back(c.q_lens[b]);
    sub.kv_lens.push_back(c.kv_lens[b]);
  }
  AttentionBuffers out = make_buffers(sub, rng);
  const size_t qb = element_size(c.q_dtype), kb = element_size(c.kv_dtype);
  const size_t q_row = batch.q_stride_token * qb;
  for (size_t i = 0; i < order.size(); ++i) {
    const int b = order[i];
    std::memcpy(out.q.data() + out.qo_indptr[i] * q_row,
                batch.q.data() + batch.qo_indptr[b] * q_row,
                static_cast<size_t>(c.q_lens[b]) * q_row);
    if (!c.paged) {
      const size_t kv_row = batch.kv_stride_token * kb;
      const size_t bytes = static_cast<size_t>(c.kv_lens[b]) * kv_row;
      std::memcpy(out.k.data() + out.kv_indptr[i] * kv_row,
                  batch.k.data() + batch.kv_indptr[b] * kv_row, bytes);
      std::memcpy(out.v.data() + out.kv_indptr[i] * kv_row,
                  batch.v.data() + batch.kv_indptr[b] * kv_row, bytes);
    } else {
      const size_t page = batch.kv_stride_page * kb;
      for (int32_t p = 0; p < batch.page_indptr[b + 1] - batch.page_indptr[b]; ++p) {
        const int32_t src = batch.page_indices[batch.page_indptr[b] + p];
        const int32_t dst = out.page_indices[out.page_indptr[i] + p];
        std::memcpy(out.k.data() + dst * page, batch.k.data() + src * page, page);
        std::memcpy(out.v.data() + dst * page, batch.v.data() + src * page, page);
      }
    }
  }
  return out;
}

// The original batch under a deterministic plan, then the same requests in other batches (each
// alone; the batch reversed followed by the batch again), each under its own deterministic plan:
// every request's o and lse rows must be bit-identical to the original batch's.
void check_batch_compositions(Device device, const AttentionCase& c) {
  std::mt19937_64 rng(23);
  AttentionBuffers batch = make_buffers(c, rng);
  const Plan batch_plan = deterministic_plan(batch, device);
  const Outputs batch_out = run_through_api(batch, device, &batch_plan);
  const int n = c.batch_size();
  std::vector<std::vector<int>> compositions = {{0}, {2}, {n - 1}};
  std::vector<int> mixed;
  for (int b = n - 1; b >= 0; --b) mixed.push_back(b);
  for (int b = 0; b < n; ++b) mixed.push_back(b);
  compositions.push_back(mixed);
  const size_t o_row = batch.o_stride_token * element_size(c.q_dtype);
  const size_t lse_row = batch.lse_stride_token * 4;
  for (const std::vector<int>& order : compositions) {
    AttentionBuffers other = rebatch(batch, order, rng);
    const Plan other_plan = deterministic_plan(other, device);
    const Outputs other_out = run_through_api(other, device, &other_plan);
    for (size_t i = 0; i < order.size(); ++i) {
      const int b = order[i];
      const size_t rows = static_cast<size_t>(c.q_lens[b]);
      const std::string where = "request " + std::to_string(b) + " at position " +
                                std::to_string(i) + " of a batch of " +
                                std::to_string(order.size()) + " on " + device_name(device) +
                                "; " + c.describe();
      ASSERT_EQ(0, std::memcmp(other_out.o.data() + other.qo_indptr[i] * o_row,
                               batch_out.o.data() + batch.qo_indptr[b] * o_row, rows * o_row))
          << "o of " << where << " differs from the original batch";
      ASSERT_EQ(0, std::memcmp(other_out.lse.data() + other.qo_indptr[i] * lse_row,
                               batch_out.lse.data() + batch.qo_indptr[b] * lse_row,
                               rows * lse_row))
          << "lse of " << where << " differs from the original batch";
    }
  }
}

void check_alone_vs_batch(Device device, DType dtype, bool paged, bool causal) {
  check_batch_compositions(device, mixed_case(dtype, paged, causal));
}

// A deterministic plan run `repeats` more times gives the first run's bytes. `expect_splits`:
// the plan must split some key range (the CPU's 512-key minimum chunk is known; a CUDA
// kernel's depends on its tile size).
void check_repeated_runs(Device device, const AttentionCase& c, int repeats,
                         bool expect_splits = false) {
  std::mt19937_64 rng(24);
  AttentionBuffers buffers = make_buffers(c, rng);
  const Plan plan = deterministic_plan(buffers, device);
  if (expect_splits) {
    ASSERT_FALSE(plan.merges.empty()) << "expected split-KV in this case; " << c.describe();
  }
  const Outputs first = run_through_api(buffers, device, &plan);
  for (int r = 0; r < repeats; ++r) {
    const Outputs again = run_through_api(buffers, device, &plan);
    ASSERT_EQ(again.o, first.o) << "o differs: run " << r + 1 << "; " << c.describe();
    ASSERT_EQ(again.lse, first.lse) << "lse differs: run " << r + 1 << "; " << c.describe();
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

TEST(DeterminismCpu, DecodeAcrossBatchCompositionsAndRepeats) {
  ThreadsGuard guard;
  for (int threads : {1, 4}) {
    set_num_threads(threads);
    for (int32_t q_per_request : {1, 4}) {
      SCOPED_TRACE(testing::Message() << "threads " << threads);
      check_batch_compositions(kCpu, decode_case(DType::kBFloat16, q_per_request));
      if (threads == 4) {
        check_repeated_runs(kCpu, decode_case(DType::kBFloat16, q_per_request), 3,
                            /*expect_splits=*/true);
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
  const int repeats = reduced_run() ? 10 : 100;
  for (bool paged : {false, true}) {
    check_repeated_runs(kCuda, mixed_case(DType::kBFloat16, paged, true), repeats);
  }
}

// Decode in deterministic mode. The CUDA decode's default plans (cuda_decode_plan_config:
// deterministic = false) split by the batch's fair share, so they are not batch-independent;
// a deterministic plan (PlanConfig::deterministic, or PlanCapacity::deterministic through the
// public plan_decode) cuts at fixed multiples of the 512-key minimum chunk, each piece's
// arithmetic depends only on its key range, and the split merge (fused into the decode kernel
// or the separate merge kernel) combines pieces in split order.
TEST(DeterminismCuda, DecodeAcrossBatchCompositions) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device: GPU determinism skipped";
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    for (int32_t q_per_request : {1, 4}) {
      check_batch_compositions(kCuda, decode_case(dtype, q_per_request));
    }
  }
}

TEST(DeterminismCuda, DecodeRepeatedRuns) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device: GPU determinism skipped";
  const int repeats = reduced_run() ? 10 : 100;
  for (int32_t q_per_request : {1, 4}) {
    check_repeated_runs(kCuda, decode_case(DType::kBFloat16, q_per_request), repeats);
  }
}

}  // namespace
}  // namespace tessera::test
